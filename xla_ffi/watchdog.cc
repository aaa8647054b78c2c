#include "watchdog.h"

#include <utility>

namespace jax_comm_gemm {

Watchdog::Watchdog(std::function<void()> poll, std::chrono::milliseconds interval)
    : poll_(std::move(poll)), interval_(interval), thread_([this] { Loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::Loop() noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, interval_, [this] { return stop_; })) {
    lock.unlock();  // a poll may take long (an abort waits for a library call)
    try {
      poll_();
    } catch (...) {
      // Nothing to report to here; the next poll tries again.
    }
    lock.lock();
  }
}

}  // namespace jax_comm_gemm
