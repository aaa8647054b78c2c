// Context: one device's share of a tensor-parallel group, and the comm-GEMM
// call on it (Run). It owns, RAII, everything a call runs on: the group's NCCL
// communicators, cuBLASMp's handle and grids, a plan per problem, the
// collective buffers, pipelined_ce's cuBLASLt handle, streams and events, and
// what the watchdog needs to tell whether calls finish (the members below).
// One per (group, device), shared (std::shared_ptr) by the Registry, the
// watchdog and each call in flight, so that none outlives it.
//
// A context is healthy until Abort(reason): a call that failed in a way that
// may leave the group out of step (a library error, a wait past the deadline),
// or the watchdog (an NCCL error, a call that never completed). Abort frees
// the communicators with ncclCommAbort (never a collective destroy); every
// later call fails with the reason, and destruction leaks what only the peers
// or a possibly stuck device could release (Abandon).
#ifndef JAX_COMM_GEMM_CONTEXT_H_
#define JAX_COMM_GEMM_CONTEXT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include <library_types.h>

#include "constants.h"
#include "library.h"
#include "pipelined.h"
#include "plan_key.h"

namespace jax_comm_gemm {

// One comm-GEMM call, in the row-major (JAX) terms of one shard:
//   AllGather:      y[n, m/P] = AG(x[n/P, k]) @ w[k, m/P]   (w[m/P, k] if transpose_w)
//   ReduceScatter:  y[n/P, m] = RS(x[n, k/P] @ w[k/P, m])   (w[m, k/P] if transpose_w)
// FP8: x and w are E4M3/E5M2, w is [m/P | m, k] (transpose_w: the TN form,
// the only one Hopper's FP8 GEMMs take), y is wider, and
//   y = (x8 . w8^T) * x_scale * w_scale
// with the dequantizing scales one float each on the device, applied by the
// GEMM through its scale pointers. The gathered x is then FP8 bytes.
struct MatmulCall {
  CommOp op = CommOp::kAllGather;
  cudaDataType_t x_type = CUDA_R_32F, w_type = CUDA_R_32F, y_type = CUDA_R_32F;
  const void* x_scale = nullptr;  // FP8 only, as are w_scale and fast_accum
  const void* w_scale = nullptr;
  bool fast_accum = false;  // Hopper's fast accumulation
  bool transpose_w = false;
  int64_t algorithm = CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT;  // constants.h
  const void* x = nullptr;
  int64_t x_rows = 0, x_cols = 0;
  const void* w = nullptr;
  int64_t w_rows = 0, w_cols = 0;
  void* y = nullptr;
  // AllGather only: where to copy the gathered x ([n, k]), or null; its size
  // and where cuBLASMp leaves it.
  void* gathered = nullptr;
  size_t gathered_bytes = 0;
  GatheredLayout layout = GatheredLayout::kFront;

  bool fp8() const { return x_scale != nullptr; }

  PlanKey key() const {
    return {op,     x_type, w_type, y_type, transpose_w, algorithm,
            x_rows, x_cols, w_rows, w_cols, fast_accum};
  }
};

// The byte offset of a `gathered_bytes` gathered operand in a cuBLASMp
// workspace of `workspace_bytes` (the size the call asked for, not the size of
// the possibly larger buffer) in a group of `nranks` (the 'tail' layout's
// padding: TailPadding in constants.h), or FailedPrecondition if it cannot fit
// there. Pure: tests/cpp/test_layout.cc.
inline Status GatheredOffset(GatheredLayout layout, size_t gathered_bytes, size_t workspace_bytes,
                             int nranks, size_t* offset) {
  const std::string sizes = "the gathered operand (" + std::to_string(gathered_bytes) +
                            " bytes) and a " + std::to_string(workspace_bytes) +
                            "-byte cuBLASMp workspace";
  switch (layout) {
    case GatheredLayout::kFront:
      if (gathered_bytes > workspace_bytes) {
        return Status::FailedPrecondition("the 'front' layout does not hold here: " + sizes +
                                          ": the operand is larger than the workspace");
      }
      *offset = 0;
      return Status();
    case GatheredLayout::kTail: {
      const size_t padding = TailPadding(nranks);
      // Compared without subtracting, so that sizes near SIZE_MAX cannot wrap.
      if (gathered_bytes > workspace_bytes || workspace_bytes - gathered_bytes < padding) {
        return Status::FailedPrecondition(
            "the 'tail' layout does not hold here: " + sizes + ": the operand and the " +
            std::to_string(padding) + "-byte tail padding of " + std::to_string(nranks) +
            " ranks do not fit");
      }
      *offset = workspace_bytes - gathered_bytes - padding;
      return Status();
    }
  }
  return Status::InvalidArgument("unknown gathered layout " +
                                 std::to_string(static_cast<int64_t>(layout)));
}

// What is made once per PlanKey and then reused.
struct Plan {
  PipelinedPlan pipelined;      // pipelined_ce's; empty for cuBLASMp's
  int64_t m = 0, n = 0, k = 0;  // cuBLASMp's global problem
  MatrixDescriptor a, b, d;
  MatmulDescriptor matmul;
  size_t device_bytes = 0, host_bytes = 0;
};

// Device memory for a group's calls, most of it allocated and released
// collectively: cuBLASMp's workspace (cublasMpMalloc, registered with NCCL
// symmetric memory on both grids as TransformerEngine does; without the
// registration cuBLASMp silently falls back to NO_OVERLAP), or pipelined_ce's
// window (ncclMemAlloc'd and registered as a symmetric window on one
// communicator, on which NCCL runs its collectives with copy engines under the
// zero-CTA policy). Where NCCL has no symmetric memory, cuBLASMp's workspace is
// plain cudaMalloc'd memory instead (AllocatePlain, local): cuBLASMp's default
// then runs without overlap.
class CollectiveBuffer {
 public:
  CollectiveBuffer() = default;
  CollectiveBuffer(const CollectiveBuffer&) = delete;
  CollectiveBuffer& operator=(const CollectiveBuffer&) = delete;
  ~CollectiveBuffer() { Release(); }

  // Each frees any previous buffer first.
  Status AllocateCublasMp(cublasMpGrid_t grid, cublasMpGrid_t other_grid, size_t size);
  Status AllocateWindow(ncclComm_t comm, size_t size);
  Status AllocatePlain(size_t size);
  void Release() {
    if (release_) release_();
    Abandon();
  }
  // Forgets the buffer without the collective release (after a peer failed).
  void Abandon() { release_ = nullptr, ptr_ = nullptr, size_ = 0; }

  char* data() const { return static_cast<char*>(ptr_); }
  size_t size() const { return size_; }

 private:
  std::function<void()> release_;  // what undoes the steps that succeeded
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

struct ContextOptions {
  int64_t group = 0;  // the Registry's key for the group, for messages
  int device = 0, nranks = 1, rank = 0;
  double call_timeout_s = 300;  // JAX_COMM_GEMM_TIMEOUT
  // pipelined_ce's block GEMMs take the fastest of cuBLASLt's candidates,
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
  // for a library call on the communicators to return before freeing them.
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
  // pipelined_ce's buffers: cuBLASLt workspace, window.
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
  // Where cuBLASMp's workspace comes from: "symmetric" (cublasMpMalloc) or,
  // where that was refused, "plain" (cudaMalloc; cuBLASMp's default runs
  // without overlap, split_p2p is refused before the library sees it).
  const char* workspace_mode() const { return workspace_error_.empty() ? "symmetric" : "plain"; }

 private:
  explicit Context(const ContextOptions& options);
  Status Init(const ncclUniqueId& id);
  Status RunLocked(cudaStream_t stream, const MatmulCall& call, Clock::time_point start);
  Status AgreeOnPlan(const PlanKey& key, Clock::time_point deadline);
  Status EnqueueKeyExchange(const PlanKey& key);
  // `stream` is XLA's, `run` the one the call's work goes on (RunLocked).
  Status MakePlan(const MatmulCall& call, cudaStream_t stream, cudaStream_t run,
                  Clock::time_point deadline, Plan* plan);
  Status MakeCublasMpPlan(const MatmulCall& call, Plan* plan);
  // Grow a buffer to hold `bytes`, once earlier calls are done with it (collective).
  Status EnsureWorkspace(size_t bytes, cudaStream_t stream, Clock::time_point deadline);
  Status EnsureWindow(size_t bytes, cudaStream_t stream, Clock::time_point deadline);
  Status EnsureLtWorkspace();
  void CountBuffers();
  // Enqueues the call's own work on `run`: cuBLASMp's or pipelined_ce's.
  Status Enqueue(const MatmulCall& call, const Plan& plan, size_t gathered_offset,
                 cudaStream_t run);
  Status Barrier(cudaStream_t stream);
  // Waits on the host until `streams` get here, up to `deadline` or an abort.
  Status WaitForStreams(std::initializer_list<cudaStream_t> streams, Clock::time_point deadline,
                        const char* what);
  // Runs `body` (library calls that may touch the communicators) under
  // comm_lock_, shared, unless the context was aborted.
  template <typename Body>
  Status WithComm(Body&& body);
  Status AbortedStatus() const;
  // NCCL's asynchronous error on any of the communicators, or "" (comm_lock_ held).
  std::string AsyncNcclError() const;
  // Aborts the context for `error` and returns it, saying so.
  Status AbortFor(Status error) noexcept;
  std::string Where() const;        // "group 7, device 0, rank 1 of 2"
  std::string PeerTimeout() const;  // "a peer did not answer within 300 s (...)"
  void Abandon() noexcept;
  // The watchdog's record of calls: an event recorded after a call's last
  // operation, with the host time it was enqueued (calls_mu_ held for both).
  Status RecordCompletion(cudaStream_t stream, Clock::time_point enqueued);
  std::optional<Status> CheckCalls(Clock::time_point now);
  void ReapLocked();

  static constexpr size_t kMaxPlans = 64;
  // cuBLASLt's workspace for pipelined_ce's GEMMs (XLA gives its own 32 MiB).
  static constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

  const ContextOptions options_;
  const Clock::duration call_timeout_;

  // Locks, in the one order they may be taken (never the other way round):
  //   mu_ -> comm_lock_ -> state_mu_ / calls_mu_ (leaves).
  // mu_ is held through a whole call, across blocking collectives, so nothing
  // that must stay responsive takes it: Abort, Watch and the queries above do
  // not. Abort takes comm_lock_ exclusively (with a timeout) so that it frees
  // the communicators only when no library call is using them. Registry::mu_
  // is never held while any of these is taken.
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

  // The watchdog's view of the calls, guarded by calls_mu_: since when one has
  // been running on the host, and those whose device work may not be done
  // (finished events are recycled through spare_).
  struct Pending {
    CudaEvent event;
    Clock::time_point enqueued;
  };
  std::mutex calls_mu_;
  std::optional<Clock::time_point> host_since_;
  std::deque<Pending> pending_;
  std::vector<CudaEvent> spare_;

  // Declared in creation order: members are destroyed in reverse, so the
  // workspace goes before the descriptors, the grids, the handle and the comm.
  // The comms never change after Init, so threads may read them without a lock.
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
  // pipelined_ce's: its transfers run on comm_stream_ (PipelineTarget).
  LtHandle lt_;
  CudaStream comm_stream_;
  CudaEvent started_;
  std::vector<CudaEvent> arrived_;   // max(nranks, kMaxChunks + 1)
  std::vector<CudaEvent> computed_;  // kMaxChunks
  DeviceBuffer lt_workspace_;        // allocated with the first pipelined plan
  CollectiveBuffer window_;          // on ce_comm_
  std::map<PlanKey, Plan> plans_;
  CollectiveBuffer workspace_;
  std::vector<char> host_workspace_;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONTEXT_H_
