#include "call_tracker.h"

#include <string>
#include <utility>

#include "library_status.h"

namespace jax_comm_gemm {
namespace {

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

CallTracker::HostCall::HostCall(CallTracker& tracker, Clock::time_point start) : tracker_(tracker) {
  std::lock_guard<std::mutex> lock(tracker_.mu_);
  tracker_.host_since_ = start;
}

CallTracker::HostCall::~HostCall() {
  std::lock_guard<std::mutex> lock(tracker_.mu_);
  tracker_.host_since_.reset();
}

void CallTracker::ReapLocked() {
  // Calls finish in the order they were enqueued (on one stream; nearly so
  // on several), so the first one not finished ends the sweep: one query per
  // call, not one per call in flight, which was a query per queued call
  // inside every call once the host ran ahead of the GPU.
  while (!pending_.empty()) {
    const cudaError_t e = cudaEventQuery(pending_.front().event.get());
    if (e != cudaSuccess) return;  // not ready yet, or an error that Check reports
    spare_.push_back(std::move(pending_.front().event));
    pending_.pop_front();
  }
}

Status CallTracker::RecordCompletion(cudaStream_t stream, Clock::time_point enqueued) {
  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();  // recycles events between the watchdog's polls
  CudaEvent event;
  if (!spare_.empty()) {
    event = std::move(spare_.back());
    spare_.pop_back();
  } else {
    cudaEvent_t e = nullptr;
    JCG_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    event.reset(e);
  }
  const cudaError_t e = cudaEventRecord(event.get(), stream);
  if (e != cudaSuccess) {
    spare_.push_back(std::move(event));
    return CudaError("cudaEventRecord", e);
  }
  pending_.push_back({std::move(event), enqueued});
  return Status();
}

std::optional<Status> CallTracker::Check(Clock::time_point now, Clock::duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_since_ && now - *host_since_ > timeout) {
    return Status::DeadlineExceeded("a call has been blocked on the host for " +
                                    FormatSeconds(SecondsBetween(*host_since_, now)));
  }
  ReapLocked();
  for (const Pending& p : pending_) {
    const cudaError_t e = cudaEventQuery(p.event.get());
    if (e != cudaSuccess && e != cudaErrorNotReady) {
      return Status::Internal("CUDA reported an error for a call: " + CudaErrorDetail(e));
    }
    if (e == cudaErrorNotReady && now - p.enqueued > timeout) {
      return Status::DeadlineExceeded("a call enqueued " +
                                      FormatSeconds(SecondsBetween(p.enqueued, now)) +
                                      " ago has not completed");
    }
  }
  return std::nullopt;
}

void CallTracker::Abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Pending& p : pending_) (void)p.event.release();
  for (CudaEvent& e : spare_) (void)e.release();
  pending_.clear();
  spare_.clear();
}

}  // namespace jax_comm_gemm
