// The fused weight gradient of the row-parallel layer's backward pass.
//
// There the AllGather+GEMM computes dx = AG(dy) @ w' and the weight gradient
// needs the same gathered dy. Unfused, the handler copies the gathered operand
// out of the buffer it was gathered into (cuBLASMp's workspace, or
// "pipelined_ce"'s window) into an XLA buffer, and XLA's GEMM reads it there.
// Fused, the same handler runs the weight-gradient GEMM itself, on cuBLASLt,
// reading the gathered operand where it lies: no copy, no [n, k] buffer in
// XLA's memory. In the AllGather+GEMM's own terms (plan.h's MatmulCall),
// with h of y's shape [n, f] (the layer's input) and dw of w's shape:
//   w [f, k] (transpose_w):  dw = h^T @ AG(x)
//   w [k, f]:                dw = AG(x)^T @ h
// It runs on the call's stream after the AllGather+GEMM, before whatever
// releases the buffer to the peers' next call (the barrier of context.cc, or
// the next call's start on the same stream).
#ifndef JAX_COMM_GEMM_WEIGHT_GRADIENT_H_
#define JAX_COMM_GEMM_WEIGHT_GRADIENT_H_

#include <cstddef>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "handles.h"
#include "status.h"

namespace jax_comm_gemm {

struct MatmulCall;  // plan.h

// The weight-gradient GEMM of one call, made once per plan.
struct WeightGradientPlan {
  LtMatmulDesc matmul;
  LtLayout a, b, d;  // column-major views; which of A and B is the gathered x: below
  bool gathered_is_a = false;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;  // what `algo` needs of the context's cuBLASLt workspace
};

// Picks the GEMM for `call` (call.dw set) on a group of `nranks`.
Status MakeWeightGradientPlan(cublasLtHandle_t lt, const MatmulCall& call, int nranks,
                              size_t workspace_bytes, WeightGradientPlan* plan);

// Enqueues dw = (as above) on `run`, `gathered` being the gathered x, [n, k]
// row-major, where the AllGather+GEMM left it.
Status EnqueueWeightGradient(cublasLtHandle_t lt, const WeightGradientPlan& plan,
                             const MatmulCall& call, const void* gathered, void* workspace,
                             size_t workspace_bytes, cudaStream_t run);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_WEIGHT_GRADIENT_H_
