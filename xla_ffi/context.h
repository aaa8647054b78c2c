// Context: everything one device needs to run cuBLASMp comm+GEMMs within one
// tensor-parallel group: the group's NCCL communicator, a cuBLASMp handle, the
// two 1-D process grids, descriptor plans per problem, and the registered
// device workspace. One per (group, device); owned by the Registry.
#ifndef JAX_COMM_GEMM_CONTEXT_H_
#define JAX_COMM_GEMM_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <library_types.h>
#include <nccl.h>

#include "handles.h"
#include "status.h"

namespace jax_comm_gemm {

enum class CommOp { kAllGather, kReduceScatter };

// Where cuBLASMp leaves the gathered operand B of an AllGather+GEMM in its
// workspace. kFront: at offset 0 (documented for cuBLASMp >= 0.11.0).
// kTail: after its cuBLASLt workspaces, ending 16 bytes before the end
// (measured for 0.10.0). Python picks one and verifies it once (registry.py).
enum class GatheredLayout : int64_t { kFront = 0, kTail = 1 };

// One comm+GEMM call, in the row-major (JAX) terms of one shard:
//   AllGather:      y[n, m/P] = AG(x[n/P, k]) @ w[k, m/P]   (w[m/P, k] if transpose_w)
//   ReduceScatter:  y[n/P, m] = RS(x[n, k/P] @ w[k/P, m])   (w[m, k/P] if transpose_w)
struct MatmulCall {
  CommOp op;
  cudaDataType_t dtype;
  bool transpose_w;
  cublasMpMatmulAlgoType_t algorithm;
  const void* x;
  int64_t x_rows, x_cols;
  const void* w;
  int64_t w_rows, w_cols;
  void* y;
  // AllGather only: where to copy the gathered x ([n, k]), or null.
  void* gathered = nullptr;
  size_t gathered_bytes = 0;
  GatheredLayout layout = GatheredLayout::kFront;
};

// How a call is ordered against the XLA work around it (JAX_COMM_GEMM_FENCE,
// which registry.py reads and passes to Registry::Connect). With cuBLASMp enqueued straight on XLA's
// compute stream, XLA work around a fused call read wrong data on the 2xH200
// test machine (about 1 run in 10 of the MLP checks; never with XLA's async
// collectives off). Each fence below but kNone removed it there; see
// benchmarks/results/2026-11-30_h200x2/README.md for the runs.
enum class Fence {
  kIsolated,   // "isolated" (default): kOwnStream, then a barrier on the group
  kOwnStream,  // "own_stream": cuBLASMp on the context's stream, joined to XLA's by events
  kBarrier,    // "barrier": on XLA's stream, a 1-element ncclAllReduce after the call
  kHost,       // "host": on XLA's stream, then wait for it on the host (slowest)
  kNone,       // "none": on XLA's stream, nothing else; for that investigation only
};

// The fences by name, the default first.
const std::vector<std::pair<std::string, Fence>>& FenceNames();
Status ParseFence(const std::string& name, Fence* out);

class Context {
 public:
  // Collective: every member of the group calls it at the same time, each on
  // its own thread (or process).
  static Status Create(int device, const ncclUniqueId& id, int nranks, int rank, Fence fence,
                       std::unique_ptr<Context>* out);
  // Collective as well (cublasMpFree, grid destruction): the Registry destroys
  // all contexts concurrently at shutdown.
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Enqueues the call on `stream`. Grows the workspace when a problem needs
  // more (collective; every rank reaches the same call in SPMD programs).
  Status Run(cudaStream_t stream, const MatmulCall& call);

  // After a peer failed: aborts the communicator and forgets the handles whose
  // destruction would wait for peers. The context must not be used again.
  void Abort();

  int device() const { return device_; }
  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  size_t workspace_bytes() const;
  size_t plan_count() const;

 private:
  // Everything that fixes the descriptors and the workspace size of a call.
  using PlanKey = std::tuple<CommOp, int, bool, int, int64_t, int64_t, int64_t, int64_t>;
  struct Plan {
    int64_t m = 0, n = 0, k = 0;
    MatrixDescriptor a, b, d;
    MatmulDescriptor matmul;
    size_t device_bytes = 0, host_bytes = 0;
  };
  static constexpr size_t kMaxPlans = 64;

  Context(int device, int nranks, int rank, Fence fence)
      : device_(device), nranks_(nranks), rank_(rank), fence_(fence) {}
  Status Init(const ncclUniqueId& id);
  Status MakePlan(const MatmulCall& call, Plan* plan) const;
  Status EnsureWorkspace(size_t bytes, cudaStream_t stream);
  Status CopyGathered(const MatmulCall& call, const Plan& plan, cudaStream_t stream) const;
  Status Barrier(cudaStream_t stream);
  Status Join(cudaStream_t waiter, cudaStream_t signaller, cudaEvent_t event);

  const int device_, nranks_, rank_;
  const Fence fence_;
  // Declared in creation order: members are destroyed in reverse, so the
  // workspace goes before the descriptors, the grids, the handle and the comm.
  NcclComm comm_;
  CudaStream stream_;  // the handle's stream; calls run on it under kIsolated and kOwnStream
  CublasMpHandle handle_;
  Grid col_grid_;  // nranks x 1: matrices split along their rows
  Grid row_grid_;  // 1 x nranks: matrices split along their columns
  CudaEvent event_in_, event_out_;  // XLA's stream -> stream_ -> XLA's stream
  DeviceBuffer barrier_word_;        // the one float the barrier all-reduces
  std::map<PlanKey, Plan> plans_;
  Workspace workspace_;
  std::vector<char> host_workspace_;
  mutable std::mutex mu_;  // one call at a time per context
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONTEXT_H_
