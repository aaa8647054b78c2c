// pipelined_ce, the project's own comm-GEMMs (pipelined.h): its plan, made
// once per problem, and the enqueueing of one call on a context's resources.
#include "pipelined.h"

#include <string>

#include "context.h"

namespace jax_comm_gemm {
namespace {

ncclDataType_t NcclType(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_16BF: return ncclBfloat16;
    case CUDA_R_16F: return ncclFloat16;
    default: return ncclFloat32;
  }
}

// A copy within this GPU. The driver runs it as a kernel: in a profiled
// timeline it did not start while a GEMM kernel held the SMs, and a GEMM
// enqueued after it waited for its end (cudaMemcpyBatchAsync with
// PreferOverlapWithCompute, NCCL's way, changed nothing;
// docs/design.md#the-projects-own-algorithms). Each caller orders it against
// the GEMMs on purpose.
Status CopyWithinDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  JCG_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  return Status();
}

// One block: y_block = x_block @ w, on `run`.
Status BlockGemm(const PipelineTarget& g, const PipelinedPlan& plan, const MatmulCall& c,
                 const void* x_block, void* y_block, cudaStream_t run) {
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASLT(cublasLtMatmul(g.lt, plan.matmul.get(), &alpha, c.w, plan.a.get(), x_block,
                              plan.b.get(), &beta, y_block, plan.d.get(), y_block, plan.d.get(),
                              &plan.algo, g.workspace, plan.workspace_bytes, run));
  return Status();
}

// AllGather+GEMM: y's rows of `shard` from those x rows, on `run`.
Status Gemm(const PipelineTarget& g, const PipelinedPlan& plan, const MatmulCall& c,
            const void* x_shard, int shard, cudaStream_t run) {
  void* y_shard = static_cast<char*>(c.y) + plan.y_shard_bytes * static_cast<size_t>(shard);
  return BlockGemm(g, plan, c, x_shard, y_shard, run);
}

// Rank `rank`'s shard of the window (AllGather+GEMM on copy engines).
char* WindowShard(const PipelineTarget& g, const PipelinedPlan& plan, int rank) {
  return g.window + plan.x_shard_bytes * static_cast<size_t>(rank);
}

// This rank's shard of x into its offset of the window, on comm_stream.
Status CopyShardIntoWindow(const PipelineTarget& g, const PipelinedPlan& plan,
                           const MatmulCall& c) {
  return CopyWithinDevice(WindowShard(g, plan, g.rank), c.x, plan.x_shard_bytes,
                          g.comm_stream);
}

// "pipelined_ce": an in-place AllGather on the window, on copy engines, once
// CopyShardIntoWindow is enqueued.
Status EnqueueCopyEngine(const PipelineTarget& g, const PipelinedPlan& plan,
                         const MatmulCall& c, cudaStream_t run) {
  const size_t shard = plan.x_shard_bytes;
  char* mine = WindowShard(g, plan, g.rank);
  // In place: this rank's shard already sits at its offset of the window.
  JCG_NCCL(ncclAllGather(mine, g.window, shard, ncclUint8, g.ce_comm, g.comm_stream));
  JCG_CUDA(cudaEventRecord(g.arrived[1].get(), g.comm_stream));
  if (c.gathered != nullptr) {
    JCG_RETURN_IF_ERROR(CopyWithinDevice(c.gathered, g.window,
                                         shard * static_cast<size_t>(g.nranks), g.comm_stream));
  }
  JCG_CUDA(cudaEventRecord(g.arrived[0].get(), g.comm_stream));
  JCG_CUDA(cudaStreamWaitEvent(run, g.arrived[1].get(), 0));
  for (int s = 1; s < g.nranks; ++s) {
    const int from = (g.rank - s + g.nranks) % g.nranks;
    JCG_RETURN_IF_ERROR(Gemm(g, plan, c, WindowShard(g, plan, from), from, run));
  }
  // The next call may overwrite the window only after these GEMMs and the copy.
  JCG_CUDA(cudaStreamWaitEvent(run, g.arrived[0].get(), 0));
  return Status();
}

// GEMM+ReduceScatter on copy engines. The window holds the partial sums to
// send, then those received, each [n, m] in ReduceScatterBlocks's order, so that
// the P blocks of one chunk are contiguous: one exchange per chunk. This
// rank's own block of a chunk is left out of the send half (it would be sent to
// itself) and computed last, adding what the peers sent.
//
// Groups over two exchange with ncclAlltoAll. Two ranks swap with an in-place
// ncclAllGather instead (SwapsBlocks): the block for the peer goes into this
// rank's own slot of the chunk, and the peer's block for this rank arrives in
// the peer's slot, so one half of the window serves both. ncclAlltoAll copies a
// rank's own (unused) slot to itself every time (NCCL's ce_coll.cc), a copy
// within the GPU that runs as a kernel, so it waited for the next chunk's GEMM
// and held the transfer behind it (seen in profiled timelines:
// docs/design.md#gemmreducescatter); an in-place AllGather copies nothing to
// itself.
bool SwapsBlocks(int nranks) { return nranks == 2; }

Status EnqueueReduceScatterCe(const PipelineTarget& g, const PipelinedPlan& plan,
                              const MatmulCall& c, cudaStream_t run) {
  const size_t count = plan.y_shard_bytes / ElementBytes(c.y_type);
  const bool swap = SwapsBlocks(g.nranks);
  const int peer = 1 - g.rank;  // swap only
  auto slot = [&](char* half, size_t chunk, int index) {
    return half + plan.y_shard_bytes * (chunk + static_cast<size_t>(index));
  };
  char* sent = g.window;
  char* received = swap ? g.window : g.window + plan.partial_bytes;
  // Where the block for `dest` is written, and where the block from `from` lands.
  auto send_slot = [&](size_t chunk, int dest) {
    return slot(sent, chunk, swap ? g.rank : dest);
  };
  auto received_slot = [&](size_t chunk, int from) { return slot(received, chunk, from); };
  const std::vector<RowBlock>& blocks = plan.blocks;
  auto x_of = [&](const RowBlock& b) {
    return static_cast<const char*>(c.x) + plan.x_row_bytes * b.x_row;
  };
  // Every GEMM is enqueued before any NCCL call: the host spends tens of
  // microseconds in each, and a GEMM enqueued behind one would leave the GPU
  // idle that long between chunks (a trace showed the AllGather's local GEMM
  // doing so). The streams' dependencies are the same either way.
  for (int j = 0; j < plan.chunks; ++j) {
    const size_t chunk = static_cast<size_t>(j) * g.nranks;
    for (int dest = 0; dest < g.nranks; ++dest) {
      if (dest == g.rank) continue;
      JCG_RETURN_IF_ERROR(BlockGemm(g, plan, c, x_of(blocks[chunk + dest]),
                                    send_slot(chunk, dest), run));
    }
    JCG_CUDA(cudaEventRecord(g.computed[j].get(), run));
  }
  for (int j = 0; j < plan.chunks; ++j) {
    const size_t chunk = static_cast<size_t>(j) * g.nranks;
    JCG_CUDA(cudaStreamWaitEvent(g.comm_stream, g.computed[j].get(), 0));
    if (swap) {
      JCG_NCCL(ncclAllGather(send_slot(chunk, peer), slot(sent, chunk, 0), count,
                             plan.nccl_type, g.ce_comm, g.comm_stream));
    } else {
      JCG_NCCL(ncclAlltoAll(slot(sent, chunk, 0), received_slot(chunk, 0), count,
                            plan.nccl_type, g.ce_comm, g.comm_stream));
    }
    JCG_CUDA(cudaEventRecord(g.arrived[j + 1].get(), g.comm_stream));
  }
  const float one = 1.0f;
  for (int j = 0; j < plan.chunks; ++j) {
    const size_t chunk = static_cast<size_t>(j) * g.nranks;
    const RowBlock& own = blocks[chunk + g.rank];
    void* y = static_cast<char*>(c.y) + plan.y_row_bytes * own.y_row;
    auto from = [&](int p) { return received_slot(chunk, p); };
    const int first = (g.rank + 1) % g.nranks;
    JCG_CUDA(cudaStreamWaitEvent(run, g.arrived[j + 1].get(), 0));
    // y = x_own @ w + (the first peer's block): the add rides on the GEMM.
    JCG_CUBLASLT(cublasLtMatmul(g.lt, plan.matmul.get(), &one, c.w, plan.a.get(), x_of(own),
                                plan.b.get(), &one, from(first), plan.d.get(), y, plan.d.get(),
                                &plan.algo, g.workspace, plan.workspace_bytes, run));
    for (int s = 2; s < g.nranks; ++s) {  // groups over 2: y += each other peer's block
      JCG_CUBLASLT(cublasLtMatrixTransform(g.lt, plan.add.get(), &one, y, plan.d.get(), &one,
                                           from((g.rank + s) % g.nranks), plan.d.get(), y,
                                           plan.d.get(), run));
    }
  }
  // Every exchange was waited for above: the window is free for the next call.
  return Status();
}

}  // namespace

size_t WindowBytes(const PipelinedPlan& plan, int nranks) {
  // ReduceScatter: the blocks to send, then those received; AllGather: the shards.
  if (plan.partial_bytes > 0) return (SwapsBlocks(nranks) ? 1 : 2) * plan.partial_bytes;
  return plan.x_shard_bytes * static_cast<size_t>(nranks);
}

// cuBLASLt sees column-major matrices, as cuBLASMp does (context.cc): the block's
// y[r, m] = x[r, k] @ w is D (m x r) = op(A) (m x k) * B (k x r), A being w.
// FP8 (MatmulCall): A = w8 transposed, B = x8, the TN form; the scale pointers are
// the call's (EnqueuePipelined points them again at each call).
Status MakePipelinedPlan(cublasLtHandle_t lt, const MatmulCall& c, int nranks,
                         size_t workspace_bytes, const GemmTrial* trial, PipelinedPlan* plan) {
  const int64_t k = c.x_cols;
  const int64_t m = c.transpose_w ? c.w_rows : c.w_cols;
  int64_t r = c.x_rows;  // AllGather: one shard
  if (c.op == CommOp::kReduceScatter) {
    plan->chunks = ChunksFor(c.x_rows / nranks, k, m);
    r = c.x_rows / nranks / plan->chunks;
    plan->partial_bytes = static_cast<size_t>(c.x_rows * m) * ElementBytes(c.y_type);
    plan->blocks = ReduceScatterBlocks(c.x_rows, nranks, plan->chunks);
    if (nranks > 2) {
      cublasLtMatrixTransformDesc_t add = nullptr;
      JCG_CUBLASLT(cublasLtMatrixTransformDescCreate(&add, CUDA_R_32F));
      plan->add.reset(add);
    }
  }
  if (r <= 0) return Status::InvalidArgument("x has no rows to multiply");
  plan->nccl_type = NcclType(c.y_type);  // the partial sums'

  const cublasOperation_t trans_a = c.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  JCG_RETURN_IF_ERROR(CreateMatmulDesc(trans_a, CUBLAS_OP_N, &plan->matmul));
  if (c.fp8()) {
    JCG_RETURN_IF_ERROR(SetFastAccumulation(plan->matmul, c.fast_accum));
    JCG_RETURN_IF_ERROR(PointFp8Scales(plan->matmul, c.w_scale, c.x_scale));
  }
  if (c.transpose_w) {  // w [m, k] row-major is A (k x m), used transposed
    JCG_RETURN_IF_ERROR(CreateLayout(c.w_type, k, m, k, &plan->a));
  } else {  // w [k, m] row-major is A (m x k)
    JCG_RETURN_IF_ERROR(CreateLayout(c.w_type, m, k, m, &plan->a));
  }
  JCG_RETURN_IF_ERROR(CreateLayout(c.x_type, k, r, k, &plan->b));
  JCG_RETURN_IF_ERROR(CreateLayout(c.y_type, m, r, m, &plan->d));
  // One block: x's first rows (a whole shard for an AllGather) into y's first.
  GemmTrial block;
  if (trial != nullptr) block = *trial, block.a = c.w, block.b = c.x, block.d = c.y;
  JCG_RETURN_IF_ERROR(PickAlgorithm(
      lt, plan->matmul, plan->a, plan->b, plan->d, workspace_bytes,
      "a " + std::to_string(r) + " x " + std::to_string(k) + " x " + std::to_string(m) + " shard",
      trial != nullptr ? &block : nullptr, &plan->algo, &plan->workspace_bytes));
  plan->x_row_bytes = static_cast<size_t>(k) * ElementBytes(c.x_type);
  plan->y_row_bytes = static_cast<size_t>(m) * ElementBytes(c.y_type);
  plan->x_shard_bytes = static_cast<size_t>(r) * plan->x_row_bytes;
  plan->y_shard_bytes = static_cast<size_t>(r) * plan->y_row_bytes;
  return Status();
}

Status EnqueuePipelined(const PipelineTarget& g, const PipelinedPlan& plan,
                        const MatmulCall& c, cudaStream_t run) {
  // cuBLASLt reads the scale pointers when a GEMM is enqueued.
  if (c.fp8()) JCG_RETURN_IF_ERROR(PointFp8Scales(plan.matmul, c.w_scale, c.x_scale));
  // Each transfer follows its own GEMM on `run`, which follows XLA's work.
  if (c.op == CommOp::kReduceScatter) {
    return EnqueueReduceScatterCe(g, plan, c, run);
  }
  // The transfers start once x is ready, that is after the work XLA enqueued
  // before the call.
  JCG_CUDA(cudaEventRecord(g.started, run));
  JCG_CUDA(cudaStreamWaitEvent(g.comm_stream, g.started, 0));
  // x goes into the window first, and the local GEMM waits for it. The copy
  // runs as a kernel (CopyWithinDevice), so it and the GEMM take turns
  // whatever the order: enqueued beside the GEMM, the copy started at the
  // GEMM's last tiles and the gather and the peer's GEMM waited behind it, a
  // serial call. Copied first, only the copy is exposed; the gather's
  // copy-engine transfers then run beside the local GEMM, as cuBLASMp's and
  // PyTorch's do (docs/design.md#the-projects-own-algorithms).
  JCG_RETURN_IF_ERROR(CopyShardIntoWindow(g, plan, c));
  JCG_CUDA(cudaEventRecord(g.computed[0].get(), g.comm_stream));
  JCG_CUDA(cudaStreamWaitEvent(run, g.computed[0].get(), 0));
  // The local shard's GEMM hides the peer transfers, and is enqueued before
  // the NCCL calls: it needs nothing from the peers, and enqueued after them
  // it started only once the host had returned from ncclAllGather, while the
  // GPU had nothing queued.
  JCG_RETURN_IF_ERROR(Gemm(g, plan, c, c.x, g.rank, run));
  return EnqueueCopyEngine(g, plan, c, run);
}

}  // namespace jax_comm_gemm
