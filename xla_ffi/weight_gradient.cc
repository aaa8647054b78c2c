#include "weight_gradient.h"

#include <string>

#include "cublaslt.h"
#include "library_status.h"
#include "plan.h"

namespace jax_comm_gemm {

// Row-major [r, c] is column-major c x r with leading dimension c. G = AG(x)
// is k x n, H = h is f x n; both are contracted over n, so the second operand
// is used transposed:
//   w [f, k]:  dw^T (k x f) = G * H^T
//   w [k, f]:  dw^T (f x k) = H * G^T
Status MakeWeightGradientPlan(cublasLtHandle_t lt, const MatmulCall& c, int nranks,
                              size_t workspace_bytes, WeightGradientPlan* plan) {
  const cudaDataType_t t = c.x_type;  // never FP8 (handlers.cc)
  const int64_t n = c.x_rows * nranks, k = c.x_cols;
  const int64_t f = c.transpose_w ? c.w_rows : c.w_cols;
  if (n <= 0 || k <= 0 || f <= 0) return Status::InvalidArgument("an empty weight gradient");
  plan->gathered_is_a = c.transpose_w;
  const int64_t a_rows = c.transpose_w ? k : f, b_rows = c.transpose_w ? f : k;
  JCG_RETURN_IF_ERROR(CreateMatmulDesc(CUBLAS_OP_N, CUBLAS_OP_T, &plan->matmul));
  JCG_RETURN_IF_ERROR(CreateLayout(t, a_rows, n, a_rows, &plan->a));
  JCG_RETURN_IF_ERROR(CreateLayout(t, b_rows, n, b_rows, &plan->b));
  JCG_RETURN_IF_ERROR(CreateLayout(t, a_rows, b_rows, a_rows, &plan->d));
  return PickAlgorithm(lt, plan->matmul, plan->a, plan->b, plan->d, workspace_bytes,
                       "the weight gradient over " + std::to_string(n) + " tokens (" +
                           std::to_string(k) + " x " + std::to_string(f) + ")",
                       /*trial=*/nullptr, &plan->algo, &plan->workspace_bytes);
}

Status EnqueueWeightGradient(cublasLtHandle_t lt, const WeightGradientPlan& plan,
                             const MatmulCall& c, const void* gathered, void* workspace,
                             size_t workspace_bytes, cudaStream_t run) {
  if (plan.workspace_bytes > workspace_bytes) {
    return Status::Internal("the weight-gradient plan needs more cuBLASLt workspace than exists");
  }
  const void* a = plan.gathered_is_a ? gathered : c.h;
  const void* b = plan.gathered_is_a ? c.h : gathered;
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASLT(cublasLtMatmul(lt, plan.matmul.get(), &alpha, a, plan.a.get(), b, plan.b.get(),
                              &beta, c.dw, plan.d.get(), c.dw, plan.d.get(), &plan.algo,
                              workspace, plan.workspace_bytes, run));
  return Status();
}

}  // namespace jax_comm_gemm
