// How a Context fails: Abort (the one way from healthy to aborted), AbortFor
// (a call's error aborts its context), Watch (the watchdog's checks), the
// messages every later call returns, and Abandon (destruction after an abort).
#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "context.h"
#include "library_status.h"

namespace jax_comm_gemm {
namespace {

// How long Abort waits for a library call on the communicator to return before
// freeing it anyway: a call blocked for longer is what the abort is there for.
constexpr auto kAbortGrace = std::chrono::seconds(5);

}  // namespace

void Context::Abandon() noexcept {
  // The peers are gone or out of step, and the device may be stuck waiting for
  // them: keep nothing whose release is collective or waits for the device.
  for (auto& [key, plan] : plans_) plan.Abandon();
  workspace_.Abandon();
  window_.Abandon();
  tracker_.Abandon();
  (void)keys_host_.release(), (void)keys_device_.release(), (void)barrier_word_.release();
  (void)host_wait_event_.release(), (void)event_out_.release(), (void)event_in_.release();
  (void)row_grid_.release(), (void)col_grid_.release(), (void)handle_.release();
  (void)lt_workspace_.release();
  (void)started_.release(), (void)comm_stream_.release();
  for (CudaEvent& e : arrived_) (void)e.release();
  for (CudaEvent& e : computed_) (void)e.release();
  (void)lt_.release();
  (void)stream_.release();
  // Already freed by ncclCommAbort.
  (void)ce_comm_.release(), (void)own_comm_.release(), (void)comm_.release();
}

void Context::Abort(const std::string& reason) noexcept {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (aborted_) return;
    try {
      error_ = reason;
    } catch (...) {
      error_.clear();  // still abort, without the reason
    }
    aborted_ = true;
  }
  std::unique_lock<std::shared_timed_mutex> lock(comm_lock_, std::defer_lock);
  (void)lock.try_lock_for(kAbortGrace);
  // One NCCL group: each ncclCommAbort raises its communicator's abort flag at
  // once and frees it only at ncclGroupEnd, after every flag is up. Aborted one
  // by one, freeing an idle communicator waited for the device, where a kernel
  // of the next one (not yet told to quit) waited for the dead peer, and the
  // survivor of a killed rank stayed stuck in its abort
  // (docs/design.md#failures-become-errors).
  (void)ncclGroupStart();
  for (ncclComm_t comm : {ce_comm_.get(), own_comm_.get(), comm_.get()}) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
  }
  (void)ncclGroupEnd();
}

std::string Context::error() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return error_;
}

std::string Context::Where() const {
  return "group " + std::to_string(options_.group) + ", device " +
         std::to_string(options_.device) + ", rank " + std::to_string(options_.rank) + " of " +
         std::to_string(options_.nranks);
}

std::string Context::PeerTimeout() const {
  return "a peer did not answer within " + FormatSeconds(options_.call_timeout_s) +
         " (JAX_COMM_GEMM_TIMEOUT)";
}

Status Context::AbortedStatus() const {
  return Status::Aborted("jax_comm_gemm: the tensor-parallel group's communicator was aborted: " +
                         error() + " (" + Where() + ")");
}

Status Context::AbortFor(Status error) noexcept {
  return CatchExceptions("jax_comm_gemm", [&]() -> Status {
    if (aborted_) return AbortedStatus();  // the first failure is the one to report
    Abort(error.message());
    error.message() = "jax_comm_gemm: " + error.message() + " (" + Where() +
                      "; the group's communicator was aborted, later calls fail)";
    return std::move(error);
  });
}

std::string Context::AsyncNcclError() const {
  for (ncclComm_t comm : {comm_.get(), own_comm_.get(), ce_comm_.get()}) {
    if (comm == nullptr) continue;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) async = r;
    if (async != ncclSuccess && async != ncclInProgress) {
      return "NCCL reported an asynchronous error: " + NcclErrorDetail(async, comm);
    }
  }
  return std::string();
}

void Context::Watch(Clock::time_point now) noexcept {
  try {
    if (aborted_ || closed_) return;
    std::string reason;
    {
      std::shared_lock<std::shared_timed_mutex> lock(comm_lock_);
      if (aborted_) return;
      reason = AsyncNcclError();
    }
    if (reason.empty()) {
      DeviceScope scope;
      if (!scope.Enter(options_.device).ok()) return;
      std::optional<Status> stall = tracker_.Check(now, call_timeout_);
      if (!stall) return;
      reason = stall->code() == Status::Code::kDeadlineExceeded
                   ? PeerTimeout() + ": " + stall->message()
                   : stall->message();
    }
    Abort(reason);
  } catch (...) {
    // Out of memory for a message: try again at the next poll.
  }
}

}  // namespace jax_comm_gemm
