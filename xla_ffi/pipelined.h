// The project's own AllGather+GEMM: the shards travel by NCCL on a side stream
// while a cuBLASLt GEMM per shard runs on the call's stream, the local shard's
// first, which hides the transfers. Two ways to move the shards:
//   "pipelined"     NCCL point-to-point straight into the gathered output, a
//                   step per peer, each shard's GEMM as soon as it is in;
//                   NCCL's kernels take SMs from the GEMM beside them.
//   "pipelined_ce"  x is copied into a symmetric window and NCCL gathers it in
//                   place on a zero-CTA communicator (copy engines, no SMs);
//                   the window is then copied into the gathered output, when
//                   one is asked for.
//
// Why beside cuBLASMp's: at 4096^3 on 2xH200 cuBLASMp's call spends 118-277 us
// of host time per call (GPU path ~113 us), so the fused op lost to XLA there.
// This path enqueues P GEMMs, P-1 NCCL groups and a few events (README,
// "Measured"). The gathered operand is the receive buffer itself: no workspace
// in between, so no copy out and no barrier for a peer's next write.
#ifndef JAX_COMM_GEMM_PIPELINED_H_
#define JAX_COMM_GEMM_PIPELINED_H_

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "handles.h"
#include "status.h"

namespace jax_comm_gemm {

struct MatmulCall;  // plan.h

// The per-shard GEMM, made once per plan: y_shard[r, m] = x_shard[r, k] @ w.
struct PipelinedPlan {
  LtMatmulDesc matmul;
  LtLayout a, b, d;  // w, one shard of x, one shard of y (column-major views)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;  // what `algo` needs of the context's cuBLASLt workspace
  size_t x_shard_bytes = 0, y_shard_bytes = 0;
};

// What a pipelined call runs on: the context's.
struct PipelineTarget {
  cublasLtHandle_t lt;
  ncclComm_t comm;           // the project's own (split off cuBLASMp's): send/recv
  cudaStream_t comm_stream;
  // started: the call's stream -> comm_stream; arrived[s] (s = 1..P-1): the
  // shard of step s is in; arrived[0]: comm_stream's last work is done.
  cudaEvent_t started;
  const CudaEvent* arrived;  // max(nranks, 2) of them
  ncclComm_t ce_comm;        // zero-CTA policy; pipelined_ce only
  char* window;              // symmetric on ce_comm, nranks shards; pipelined_ce only
  void* workspace;
  size_t workspace_bytes;
  int rank, nranks;
};

// One step of the point-to-point exchange: `bytes` of `send` to rank `to`,
// the same from rank `from` into `receive`, as one NCCL group on `stream`.
Status SendReceive(const void* send, void* receive, size_t bytes, int to, int from,
                   ncclComm_t comm, cudaStream_t stream);

// Picks the GEMM algorithm for `call` (an AllGather+GEMM) with cuBLASLt's
// heuristic, within `workspace_bytes` of workspace.
Status MakePipelinedPlan(cublasLtHandle_t lt, const MatmulCall& call, size_t workspace_bytes,
                         PipelinedPlan* plan);

// Enqueues `call` on `run` (and target.comm_stream, joined back to `run`).
// Collective: every rank of the group enqueues the same call.
Status EnqueuePipelined(const PipelineTarget& target, const PipelinedPlan& plan,
                        const MatmulCall& call, cudaStream_t run);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_PIPELINED_H_
