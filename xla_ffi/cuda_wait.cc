#include "cuda_wait.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "library_status.h"

namespace jax_comm_gemm {

DeviceScope::~DeviceScope() {
  int now = -1;
  if (entered_ && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    (void)cudaSetDevice(previous_);
  }
}

Status DeviceScope::Enter(int device) {
  JCG_CUDA(cudaGetDevice(&previous_));
  if (previous_ != device) JCG_CUDA(cudaSetDevice(device));
  entered_ = true;
  return Status();
}

Status WaitForEvent(cudaEvent_t event, Clock::time_point deadline,
                    const std::atomic<bool>& give_up) {
  // Yield at first (most waits are short), then sleep with a growing pause
  // of at most 1 ms, so that a long wait costs no CPU.
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(200);
  std::chrono::microseconds pause(10);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return Status();
    if (e != cudaErrorNotReady) return CudaError("cudaEventQuery", e);
    if (give_up.load()) return Status::Aborted(std::string());
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return Status::DeadlineExceeded(std::string());
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

Clock::duration SecondsToDuration(double seconds) {
  const double clamped = seconds > 0 ? std::min(seconds, 1e8) : 0.0;  // NaN -> 0
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(clamped));
}

std::string FormatSeconds(double seconds) {
  char buffer[32];
  // Whole seconds from 100 on ("300 s"), else 3 significant digits ("2.5 s").
  std::snprintf(buffer, sizeof(buffer), seconds >= 100 ? "%.0f s" : "%.3g s", seconds);
  return buffer;
}

}  // namespace jax_comm_gemm
