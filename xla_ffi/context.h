// Context: everything one device needs to run comm+GEMMs within one
// tensor-parallel group: the group's NCCL communicator (cuBLASMp's) and two
// split from it (the project's own collectives; pipelined_ce), a cuBLASMp
// handle, the two 1-D process grids, descriptor plans per problem, the
// registered device workspace, the pipelined algorithms' cuBLASLt handle,
// stream and events (pipelined.h), and what the watchdog needs to tell whether
// its calls finish.
// One per (group, device), shared (std::shared_ptr) by the Registry, the
// watchdog and each call in flight, so that none of them outlives it.
//
// A context is healthy until Abort(reason): a call that failed in a way that
// may leave the group out of step (a library error, a wait past the deadline),
// or the watchdog (an NCCL error, a call that never completed). Abort frees
// the communicator with ncclCommAbort (never a collective destroy); every later
// call fails with the reason, and destruction leaks what only the peers or a
// possibly stuck device could release (Abandon).
#ifndef JAX_COMM_GEMM_CONTEXT_H_
#define JAX_COMM_GEMM_CONTEXT_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "call_tracker.h"
#include "cuda_wait.h"
#include "handles.h"
#include "plan.h"
#include "plan_key.h"
#include "status.h"

namespace jax_comm_gemm {

struct ContextOptions {
  int64_t group = 0;  // the Registry's key for the group, for messages
  int device = 0, nranks = 1, rank = 0;
  double call_timeout_s = 300;  // JAX_COMM_GEMM_TIMEOUT
  // The own algorithms' block GEMMs take the fastest of cuBLASLt's candidates,
  // timed at their plan's first call; else its first choice (JAX_COMM_GEMM_AUTOTUNE=off).
  bool time_gemms = true;
};

class Context {
 public:
  // Collective: every member of the group calls it at the same time, each on
  // its own thread (or process).
  static Status Create(const ContextOptions& options, const ncclUniqueId& id,
                       std::shared_ptr<Context>* out);
  // Collective while healthy (cublasMpFree, grid destruction): the Registry
  // destroys all contexts concurrently at shutdown. Local after an abort.
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Enqueues the call on `stream`. The first call of a plan checks that every
  // rank made the same plan; a call grows the workspace when it needs more
  // (collective). A check that fails alike on every rank before the call's
  // collectives (a plan mismatch, a layout that does not fit) leaves the
  // context usable; any other failure aborts it: its peers are out of step.
  Status Run(cudaStream_t stream, const MatmulCall& call) noexcept;

  // Any thread, any time; the first reason wins. Waits a few seconds at most
  // for a library call on the communicator to return before freeing it.
  void Abort(const std::string& reason) noexcept;

  // The watchdog's poll: aborts the context on an NCCL asynchronous error or
  // on a call that has outlived the call timeout.
  void Watch(Clock::time_point now) noexcept;

  // At shutdown: later calls fail at once.
  void Close() noexcept { closed_ = true; }

  int64_t group() const { return options_.group; }
  int device() const { return options_.device; }
  int nranks() const { return options_.nranks; }
  int rank() const { return options_.rank; }
  // These never wait for a call in flight (Registry::Describe polls them).
  size_t workspace_bytes() const { return workspace_bytes_.load(); }
  // The own algorithms' buffers: cuBLASLt workspace, window.
  size_t own_buffer_bytes() const { return own_buffer_bytes_.load(); }
  size_t plan_count() const { return plan_count_.load(); }
  // Calls run, and the host time they took (from taking the context's lock
  // to the last enqueue), since the context was made: at small GEMMs the
  // host, not the GPU, sets the pace of back-to-back calls (docs/performance.md).
  uint64_t calls() const { return calls_.load(); }
  double host_seconds() const { return host_ns_.load() * 1e-9; }
  std::string error() const;  // "" while healthy, else why it was aborted
  // "" where cuBLASMp got a workspace at set-up, else the library's refusal
  // (set in Create, constant afterwards).
  const std::string& workspace_error() const { return workspace_error_; }

 private:
  explicit Context(const ContextOptions& options);
  Status Init(const ncclUniqueId& id);
  Status RunLocked(cudaStream_t stream, const MatmulCall& call, Clock::time_point start);
  Status AgreeOnPlan(const PlanKey& key, Clock::time_point deadline);
  Status EnqueueKeyExchange(const PlanKey& key);
  Status EnsureWorkspace(size_t bytes, cudaStream_t stream, Clock::time_point deadline);
  Status WaitForStream(cudaStream_t stream, Clock::time_point deadline, const char* what);
  Status Barrier(cudaStream_t stream);
  // `stream` is XLA's, `run` the one the call's work goes on (RunLocked).
  Status MakePlanFor(const MatmulCall& call, cudaStream_t stream, cudaStream_t run,
                     Clock::time_point deadline, Plan* plan);
  Status EnsureWindow(size_t bytes, cudaStream_t stream,
                      Clock::time_point deadline);  // pipelined_ce
  void CountOwnBuffers();  // own_buffer_bytes_, after one of them changed
  // Enqueues the call's own work on `run`: cuBLASMp's or the pipelined one.
  Status Enqueue(const MatmulCall& call, const Plan& plan, size_t gathered_offset,
                 cudaStream_t run);
  Status Join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event);
  // Runs `body` (library calls that may touch the communicator) under
  // comm_lock_, shared, unless the context was aborted.
  template <typename Body>
  Status WithComm(Body&& body);
  Status AbortedStatus() const;
  // NCCL's asynchronous error on any of the communicators, or "" (comm_lock_ held).
  std::string AsyncNcclError() const;
  // Aborts the context for `error` and returns it, saying so.
  Status AbortFor(Status error) noexcept;
  std::string Where() const;       // "group 7, device 0, rank 1 of 2"
  std::string PeerTimeout() const;  // "a peer did not answer within 300 s (...)"
  void Abandon() noexcept;

  static constexpr size_t kMaxPlans = 64;
  Status EnsureLtWorkspace();
  // cuBLASLt's workspace for the own GEMMs (XLA gives its own 32 MiB).
  static constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

  const ContextOptions options_;
  const Clock::duration call_timeout_;

  // Locks, in the one order they may be taken (never the other way round):
  //   mu_ -> comm_lock_ -> state_mu_ / the CallTracker's mutex (leaves).
  // mu_ is held through a whole call, across blocking collectives, so nothing
  // that must stay responsive takes it: Abort, Watch and the queries above do
  // not. Abort takes comm_lock_ exclusively (with a timeout) so that it frees
  // the communicator only when no library call is using it. Registry::mu_ is
  // never held while any of these is taken.
  std::mutex mu_;  // one call at a time per context
  std::shared_timed_mutex comm_lock_;
  mutable std::mutex state_mu_;
  std::string error_;  // guarded by state_mu_
  std::string workspace_error_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> closed_{false};
  std::atomic<size_t> workspace_bytes_{0};
  std::atomic<size_t> own_buffer_bytes_{0};
  std::atomic<size_t> plan_count_{0};
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> host_ns_{0};
  CallTracker tracker_;

  // Declared in creation order: members are destroyed in reverse, so the
  // workspace goes before the descriptors, the grids, the handle and the comm.
  // comm_ never changes after Init, so threads may read it without a lock.
  NcclComm comm_;      // cuBLASMp's (its grids)
  NcclComm own_comm_;  // split from comm_: the project's barrier and plan agreement
  NcclComm ce_comm_;   // split from comm_ with NCCL's zero-CTA policy (pipelined_ce)
  CudaStream stream_;  // the handle's stream; every call runs on it (RunLocked)
  CublasMpHandle handle_;
  Grid col_grid_;  // nranks x 1: matrices split along their rows
  Grid row_grid_;  // 1 x nranks: matrices split along their columns
  CudaEvent event_in_, event_out_;  // XLA's stream -> stream_ -> XLA's stream
  CudaEvent host_wait_event_;       // the bounded host waits, one at a time
  DeviceBuffer barrier_word_;       // the one float the barrier all-reduces
  DeviceBuffer keys_device_;        // plan agreement: this rank's key, then all ranks'
  PinnedHostBuffer keys_host_;      // pinned, so the copies never block the host
  // The pipelined algorithm's: its transfers run on comm_stream_.
  LtHandle lt_;
  CudaStream comm_stream_;
  CudaEvent started_;
  std::vector<CudaEvent> arrived_;  // max(nranks, kMaxChunks + 1): see PipelineTarget
  std::vector<CudaEvent> computed_;  // kMaxChunks: see PipelineTarget
  DeviceBuffer lt_workspace_;       // allocated with the first plan of a cuBLASLt GEMM
  SymmetricWindow window_;          // pipelined_ce's, on ce_comm_
  std::map<PlanKey, Plan> plans_;
  Workspace workspace_;
  std::vector<char> host_workspace_;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONTEXT_H_
