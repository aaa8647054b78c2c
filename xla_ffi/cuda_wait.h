// Host-side helpers around CUDA shared by the context and the watchdog:
// DeviceScope, and a wait for an event that ends at a deadline or on an abort
// instead of never (cudaEventSynchronize would block for good on a peer that
// does not answer).
#ifndef JAX_COMM_GEMM_CUDA_WAIT_H_
#define JAX_COMM_GEMM_CUDA_WAIT_H_

#include <atomic>
#include <chrono>
#include <string>

#include <cuda_runtime_api.h>

#include "status.h"

namespace jax_comm_gemm {

using Clock = std::chrono::steady_clock;

// cudaSetDevice for the current thread, restored on scope exit.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope();
  Status Enter(int device);

 private:
  int previous_ = -1;
  bool entered_ = false;
};

// Polls `event` until it completes (OK), `deadline` passes (DeadlineExceeded,
// empty message), `give_up` turns true (Aborted, empty message) or CUDA
// reports an error (Internal).
Status WaitForEvent(cudaEvent_t event, Clock::time_point deadline,
                    const std::atomic<bool>& give_up);

// `seconds` as a Clock duration, clamped to [0, 10^8 s] so that a huge or
// infinite timeout means "wait very long", not an overflow.
Clock::duration SecondsToDuration(double seconds);

// "300 s", "2.5 s": durations in messages.
std::string FormatSeconds(double seconds);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CUDA_WAIT_H_
