// CallTracker: what the watchdog needs to know about one context's calls:
// since when a call has been running on the host (if one is), and, for every
// call whose device work may not have finished, an event recorded after its
// last operation and the host time it was enqueued. Run records, the watchdog
// checks; its mutex is a leaf lock (nothing else is taken while it is held).
#ifndef JAX_COMM_GEMM_CALL_TRACKER_H_
#define JAX_COMM_GEMM_CALL_TRACKER_H_

#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda_wait.h"
#include "handles.h"
#include "status.h"

namespace jax_comm_gemm {

class CallTracker {
 public:
  CallTracker() = default;
  CallTracker(const CallTracker&) = delete;
  CallTracker& operator=(const CallTracker&) = delete;

  // Marks a call as running on the host for the life of the object.
  class HostCall {
   public:
    HostCall(CallTracker& tracker, Clock::time_point start);
    ~HostCall();
    HostCall(const HostCall&) = delete;
    HostCall& operator=(const HostCall&) = delete;

   private:
    CallTracker& tracker_;
  };

  // Records an event on `stream` (of the current device) after a call's last
  // operation; `enqueued` is when the call started on the host.
  Status RecordCompletion(cudaStream_t stream, Clock::time_point enqueued);

  // Forgets finished calls. Returns why the context must be aborted, if it
  // must: DeadlineExceeded naming the call that has run longer than `timeout`,
  // or Internal with the CUDA error an event reports. The current device must
  // be the events' device.
  std::optional<Status> Check(Clock::time_point now, Clock::duration timeout);

  // Leaks the events: after an abort their device may be stuck, and nothing
  // here may wait for it.
  void Abandon();

 private:
  struct Pending {
    CudaEvent event;
    Clock::time_point enqueued;
  };
  // Moves the finished events at the front to spare_; stops at the first call
  // not finished, or at an error, which Check reports.
  void ReapLocked();

  std::mutex mu_;
  std::optional<Clock::time_point> host_since_;
  std::deque<Pending> pending_;
  std::vector<CudaEvent> spare_;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CALL_TRACKER_H_
