// The project's own comm-GEMMs ("pipelined_ce"): a cuBLASLt GEMM per block of
// rows on the call's stream while NCCL moves the blocks on a side stream, on
// copy engines, which hides the transfers and leaves the GEMMs every SM.
// AllGather+GEMM: x is copied into a symmetric window, before the local
// shard's GEMM, and NCCL gathers it in place on a zero-CTA communicator beside
// that GEMM; the window is then copied into the gathered output, when one is
// asked for.
// GEMM+ReduceScatter: x's rows are cut into blocks, a
// chunk of every destination rank's rows at a time, in one order on every rank
// (ReduceScatterBlocks); XLA's psum_scatter instead waits for the whole GEMM, then moves
// everything. The peers' blocks of a chunk are computed first into a symmetric
// window and swapped on the zero-CTA communicator (copy engines): an
// ncclAlltoAll, or for two ranks an in-place ncclAllGather, which copies
// nothing to itself; then each own block's GEMM adds what arrived (beta = 1,
// C = the received block).
//
// Why beside cuBLASMp's: this path enqueues P GEMMs, one NCCL call per chunk
// and a few events, a fraction of cuBLASMp's host time per call
// (docs/design.md#the-projects-own-algorithms). No barrier after the call:
// NCCL's copy-engine collectives start with a ready handshake of every rank
// (its ce_coll.cc), so no peer's next call writes into this rank's window
// early (docs/design.md#ordering-against-xla-the-fence).
#ifndef JAX_COMM_GEMM_PIPELINED_H_
#define JAX_COMM_GEMM_PIPELINED_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "cublaslt.h"
#include "library.h"

namespace jax_comm_gemm {

struct MatmulCall;  // context.h

// How the GEMM+ReduceScatter splits x's rows into blocks. Pure and inline:
// tests/cpp/test_chunks.cc checks it on the CPU. A rank's rows make at most
// kMaxChunks chunks, each of at least kMinChunkRows rows (smaller GEMMs lose
// efficiency), and four only where one block's GEMM does at least
// kMinFourChunkBlockFlop: its GPU time must outlast the host's enqueueing of a
// chunk (an NCCL call and the cuBLASLt launches), or the calls are host-bound
// (measured: docs/design.md#gemmreducescatter, docs/performance.md).
inline constexpr int64_t kMinChunkRows = 256;
inline constexpr int kMaxChunks = 4;
inline constexpr double kMinFourChunkBlockFlop = 4e10;

// How many chunks a destination rank's `rows` rows make (1, 2 or 4; always
// a divisor of `rows`), each block's GEMM being rows/chunks x k x m.
inline int ChunksFor(int64_t rows, int64_t k, int64_t m) {
  auto fits = [&](int chunks) { return rows % chunks == 0 && rows / chunks >= kMinChunkRows; };
  const double block_flop = 2.0 * static_cast<double>(rows / kMaxChunks) * k * m;
  if (fits(kMaxChunks) && block_flop >= kMinFourChunkBlockFlop) return kMaxChunks;
  return fits(2) ? 2 : 1;
}

struct RowBlock {
  int dest;       // the rank that owns the sums of these rows
  int64_t x_row;  // first row in x [n, k/P]
  int64_t y_row;  // first row in the owner's y [n/P, m]
};

// The blocks of `rows` = n rows over `nranks` ranks, `chunks` per rank, each
// n / (nranks * chunks) rows, in the order every rank enqueues them (each
// chunk's exchange is collective): chunk 0 of every destination, then chunk 1,
// ..., so the P blocks of one chunk are contiguous (one exchange per chunk).
inline std::vector<RowBlock> ReduceScatterBlocks(int64_t rows, int nranks, int chunks) {
  const int64_t per_rank = rows / nranks, per_block = per_rank / chunks;
  std::vector<RowBlock> blocks;
  blocks.reserve(static_cast<size_t>(nranks) * chunks);
  for (int j = 0; j < chunks; ++j) {
    for (int dest = 0; dest < nranks; ++dest) {
      blocks.push_back({dest, dest * per_rank + j * per_block, j * per_block});
    }
  }
  return blocks;
}

// The per-block GEMM, made once per plan: y_block[r, m] = x_block[r, k] @ w. A
// block is one shard of x (AllGather) or one chunk of a destination's rows
// (ReduceScatter: `chunks` per rank).
struct PipelinedPlan {
  LtMatmulDesc matmul;
  LtLayout a, b, d;  // w, one block of x, one block of y (column-major views)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;  // what `algo` needs of the context's cuBLASLt workspace
  size_t x_shard_bytes = 0, y_shard_bytes = 0;  // one block's
  size_t x_row_bytes = 0, y_row_bytes = 0;
  int chunks = 1;                // ReduceScatter: blocks per destination rank
  std::vector<RowBlock> blocks;  // ReduceScatter: in enqueue order
  LtTransformDesc add;       // ReduceScatter, groups over 2: y += received
  size_t partial_bytes = 0;  // ReduceScatter: the partial sums of all rows, [n, m]
  ncclDataType_t nccl_type = ncclFloat32;
};

// What a pipelined call runs on: the context's.
struct PipelineTarget {
  cublasLtHandle_t lt;
  cudaStream_t comm_stream;
  // started: the call's stream -> comm_stream; arrived[s] (s = 1..P-1): the
  // shard of step s is in (ReduceScatter: chunk s-1 is); arrived[0]:
  // comm_stream's last work is done.
  cudaEvent_t started;
  const CudaEvent* arrived;  // max(nranks, kMaxChunks + 1) of them
  // computed[j]: chunk j's blocks for the peers are computed (ReduceScatter);
  // kMaxChunks of them. pipelined_ce AllGather: computed[0], x is in the
  // window.
  const CudaEvent* computed;
  ncclComm_t ce_comm;        // zero-CTA policy
  char* window;              // symmetric on ce_comm
  void* workspace;
  size_t workspace_bytes;
  int rank, nranks;
};

// The window bytes pipelined_ce needs for `plan`.
size_t WindowBytes(const PipelinedPlan& plan, int nranks);

// Picks the block GEMM's algorithm for `call` on a group of `nranks`, within
// `workspace_bytes` of workspace: cuBLASLt's first choice, or with `trial` the
// fastest of its candidates, timed on one block of the call's own operands
// (trial's a, b and d are set here).
Status MakePipelinedPlan(cublasLtHandle_t lt, const MatmulCall& call, int nranks,
                         size_t workspace_bytes, const GemmTrial* trial, PipelinedPlan* plan);

// Enqueues `call` on `run` (and target.comm_stream, joined back to `run`).
// Collective: every rank of the group enqueues the same call.
Status EnqueuePipelined(const PipelineTarget& target, const PipelinedPlan& plan,
                        const MatmulCall& call, cudaStream_t run);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_PIPELINED_H_
