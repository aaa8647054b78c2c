#include "cublaslt.h"

#include <string>

namespace jax_comm_gemm {
namespace {

template <typename T>
Status SetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                    const T& value) {
  JCG_CUBLASLT(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
  return Status();
}

}  // namespace

Status CreateLayout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, LtLayout* out) {
  cublasLtMatrixLayout_t layout = nullptr;
  JCG_CUBLASLT(cublasLtMatrixLayoutCreate(&layout, t, rows, cols, ld));
  out->reset(layout);
  return Status();
}

Status CreateMatmulDesc(cublasOperation_t trans_a, cublasOperation_t trans_b, LtMatmulDesc* out) {
  cublasLtMatmulDesc_t desc = nullptr;
  JCG_CUBLASLT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  out->reset(desc);
  JCG_RETURN_IF_ERROR(SetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a));
  return SetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
}

Status PickAlgorithm(cublasLtHandle_t lt, const LtMatmulDesc& desc, const LtLayout& a,
                     const LtLayout& b, const LtLayout& d, size_t workspace_bytes,
                     const std::string& what, cublasLtMatmulAlgo_t* algo, size_t* needs) {
  cublasLtMatmulPreference_t pref_raw = nullptr;
  JCG_CUBLASLT(cublasLtMatmulPreferenceCreate(&pref_raw));
  LtPreference pref(pref_raw);
  const uint64_t max_workspace = workspace_bytes;
  JCG_CUBLASLT(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
      sizeof(max_workspace)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  JCG_CUBLASLT(cublasLtMatmulAlgoGetHeuristic(lt, desc.get(), a.get(), b.get(), d.get(),
                                              d.get(), pref.get(), 1, &result, &found));
  if (found == 0) return Status::InvalidArgument("cuBLASLt has no GEMM algorithm for " + what);
  *algo = result.algo;
  *needs = result.workspaceSize;
  return Status();
}

}  // namespace jax_comm_gemm
