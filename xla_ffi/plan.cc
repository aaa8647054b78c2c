#include "plan.h"

#include "library_status.h"

namespace jax_comm_gemm {
namespace {

template <typename T>
Status SetAttribute(cublasMpMatmulDescriptor_t desc, cublasMpMatmulDescriptorAttribute_t attr,
                    const T& value) {
  JCG_CUBLASMP(cublasMpMatmulDescriptorSetAttribute(desc, attr, &value, sizeof(value)));
  return Status();
}

Status CreateMatrix(int64_t m, int64_t n, int64_t mb, int64_t nb, int64_t lld,
                    cudaDataType_t type, cublasMpGrid_t grid, MatrixDescriptor* out) {
  cublasMpMatrixDescriptor_t desc = nullptr;
  JCG_CUBLASMP(cublasMpMatrixDescriptorCreate(m, n, mb, nb, 0, 0, lld, type, grid, &desc));
  out->reset(desc);
  return Status();
}

}  // namespace

// cuBLASMp's A is w, its B is x; the modes stay SCALAR_FP32 (one scale each).
Status PointScales(const MatmulDescriptor& matmul, const MatmulCall& c) {
  JCG_RETURN_IF_ERROR(
      SetAttribute(matmul.get(), CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_A_SCALE_POINTER, c.w_scale));
  return SetAttribute(matmul.get(), CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_B_SCALE_POINTER,
                      c.x_scale);
}

// cuBLASMp sees column-major matrices: a row-major [r, c] array is its [c, r]
// transpose. So y = x @ w becomes D = A * B with A = w^T, B = x^T, D = y^T, and
// the token dimension is cuBLASMp's n.
Status MakePlan(const PlanTarget& g, const MatmulCall& c, Plan* plan) {
  const int64_t P = g.nranks;
  const cudaDataType_t tw = c.w_type, tx = c.x_type, ty = c.y_type;
  const cublasOperation_t trans_a = c.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (c.op == CommOp::kAllGather) {
    // x [n/P, k] is B (k x n, columns split); y [n, m/P] is D (m x n, rows split).
    const int64_t nl = c.x_rows, k = c.x_cols;
    const int64_t ml = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = ml * P, plan->n = nl * P, plan->k = k;
    if (c.transpose_w) {  // w [m/P, k] is op(A) = A^T with A k x m, columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->m, k, ml, k, tw, g.row_grid, &plan->a));
    } else {  // w [k, m/P] is A (m x k), rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, k, ml, k, ml, tw, g.col_grid, &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(k, plan->n, k, nl, k, tx, g.row_grid, &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->m, plan->n, ml, nl, ml, ty, g.col_grid, &plan->d));
  } else {
    // x [n, k/P] is B (k x n, rows split); y [n/P, m] is D (m x n, columns split).
    const int64_t n = c.x_rows, kl = c.x_cols, nl = n / P;
    const int64_t m = c.transpose_w ? c.w_rows : c.w_cols;
    plan->m = m, plan->n = n, plan->k = kl * P;
    if (c.transpose_w) {  // w [m, k/P] is op(A) = A^T with A k x m, rows split.
      JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, m, kl, m, kl, tw, g.col_grid, &plan->a));
    } else {  // w [k/P, m] is A (m x k), columns split.
      JCG_RETURN_IF_ERROR(CreateMatrix(m, plan->k, m, kl, m, tw, g.row_grid, &plan->a));
    }
    JCG_RETURN_IF_ERROR(CreateMatrix(plan->k, n, kl, nl, kl, tx, g.col_grid, &plan->b));
    JCG_RETURN_IF_ERROR(CreateMatrix(m, n, m, nl, m, ty, g.row_grid, &plan->d));
  }
  cublasMpMatmulDescriptor_t md = nullptr;
  JCG_CUBLASMP(cublasMpMatmulDescriptorCreate(&md, CUBLAS_COMPUTE_32F));
  plan->matmul.reset(md);
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSA, trans_a));
  JCG_RETURN_IF_ERROR(SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSB, trans_b));
  JCG_RETURN_IF_ERROR(
      SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_ALGO_TYPE,
                   static_cast<cublasMpMatmulAlgoType_t>(c.algorithm)));
  if (c.op == CommOp::kReduceScatter) {
    // Partial sums travel in the output type, as XLA's psum_scatter does.
    JCG_RETURN_IF_ERROR(
        SetAttribute(md, CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_COMMUNICATION_TYPE, ty));
  }
  if (c.fp8()) JCG_RETURN_IF_ERROR(PointScales(plan->matmul, c));
  const float alpha = 1.0f, beta = 0.0f;
  JCG_CUBLASMP(cublasMpMatmul_bufferSize(
      g.handle, md, plan->m, plan->n, plan->k, &alpha, c.w, 1, 1, plan->a.get(), c.x, 1, 1,
      plan->b.get(), &beta, nullptr, 1, 1, nullptr, c.y, 1, 1, plan->d.get(),
      &plan->device_bytes, &plan->host_bytes));
  return Status();
}

}  // namespace jax_comm_gemm
