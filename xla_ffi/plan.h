// MatmulCall, one comm-GEMM call as the handlers see it, and Plan, what is made
// for it once and then reused: cuBLASMp's descriptors and workspace sizes, or
// for the project's own pipelined algorithm its cuBLASLt plan (pipelined.h).
#ifndef JAX_COMM_GEMM_PLAN_H_
#define JAX_COMM_GEMM_PLAN_H_

#include <cstddef>
#include <cstdint>

#include <cublasmp.h>
#include <library_types.h>

#include "constants.h"
#include "handles.h"
#include "pipelined.h"
#include "plan_key.h"
#include "status.h"

namespace jax_comm_gemm {

// One comm+GEMM call, in the row-major (JAX) terms of one shard:
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
  const void* x_scale = nullptr;  // FP8 only, as is w_scale
  const void* w_scale = nullptr;
  bool fast_accum = false;        // FP8 only: Hopper's fast accumulation
  bool transpose_w = false;
  int64_t algorithm = CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT;  // algorithms.h
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
    PlanKey k;
    k.op = op;
    k.x_type = x_type, k.w_type = w_type, k.y_type = y_type;
    k.transpose_w = transpose_w;
    k.algorithm = algorithm;
    k.x_rows = x_rows, k.x_cols = x_cols, k.w_rows = w_rows, k.w_cols = w_cols;
    k.fast_accum = fast_accum;
    return k;
  }
};

struct Plan {
  PipelinedPlan pipelined;      // the pipelined algorithm's; empty for cuBLASMp's
  int64_t m = 0, n = 0, k = 0;  // cuBLASMp's global problem
  MatrixDescriptor a, b, d;
  MatmulDescriptor matmul;
  size_t device_bytes = 0, host_bytes = 0;

  // Leaks the descriptors (after an abort; see Context::Abandon).
  void Abandon() {
    (void)a.release(), (void)b.release(), (void)d.release(), (void)matmul.release();
  }
};

// What a plan is made on: one context's handle and grids.
struct PlanTarget {
  cublasMpHandle_t handle;
  cublasMpGrid_t col_grid;  // nranks x 1: matrices split along their rows
  cublasMpGrid_t row_grid;  // 1 x nranks: matrices split along their columns
  int64_t nranks;
};

// Creates the cuBLASMp descriptors of `call` and asks cuBLASMp for its
// workspace sizes (not for the pipelined algorithm: MakePipelinedPlan).
Status MakePlan(const PlanTarget& target, const MatmulCall& call, Plan* plan);

// FP8: points `matmul` (a plan's cuBLASMp descriptor) at the scales of `call`,
// which change from call to call.
Status PointScales(const MatmulDescriptor& matmul, const MatmulCall& call);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_PLAN_H_
