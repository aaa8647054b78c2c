// Watchdog: one thread that calls `poll` every `interval` until the object is
// destroyed. The Registry owns one (started at the first connect, stopped at
// shutdown) whose poll asks each context to check its communicator and calls.
// Plain C++ (no CUDA), unit-tested on the CPU.
#ifndef JAX_COMM_GEMM_WATCHDOG_H_
#define JAX_COMM_GEMM_WATCHDOG_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace jax_comm_gemm {

class Watchdog {
 public:
  // `poll` must not throw; an exception from it is dropped, not propagated.
  Watchdog(std::function<void()> poll, std::chrono::milliseconds interval);
  // Stops and joins the thread: never destroy it while holding a lock that
  // `poll` takes.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void Loop() noexcept;

  const std::function<void()> poll_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_WATCHDOG_H_
