// The cuBLASLt pieces the project's own GEMMs share (pipelined.cc,
// fp8_gemm.cc): matrix layouts, descriptor attributes, and an algorithm
// picked once per plan, by cuBLASLt's heuristic or by timing its candidates.
#ifndef JAX_COMM_GEMM_CUBLASLT_H_
#define JAX_COMM_GEMM_CUBLASLT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include "library.h"
#include "timed_pick.h"

namespace jax_comm_gemm {

inline size_t ElementBytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2: return 1;
    default: return 2;
  }
}

// A column-major rows x cols matrix with leading dimension `ld`.
Status CreateLayout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, LtLayout* out);

// A GEMM descriptor with float32 accumulation and scaling (as cuBLASMp's
// CUBLAS_COMPUTE_32F) and the given operations on A and B.
Status CreateMatmulDesc(cublasOperation_t trans_a, cublasOperation_t trans_b, LtMatmulDesc* out);

// FP8 operands: the device pointers to A's and B's dequantizing scales, one
// float each (SCALAR_32F, the default mode) or as SetFp8ScaleModes says (a
// cublasLtMatmulMatrixScale_t each: one per row, per block), applied in f32
// before the one rounding to D's type. The pointers are per call: point them
// again before each call's GEMMs (the modes stay).
Status PointFp8Scales(const LtMatmulDesc& desc, const void* a_scale, const void* b_scale);
Status SetFp8ScaleModes(const LtMatmulDesc& desc, int32_t a_mode, int32_t b_mode);

// Hopper's FP8 fast accumulation: partial sums are not promoted to f32 along
// k (faster, less precise; XLA's default for an FP8 dot).
Status SetFastAccumulation(const LtMatmulDesc& desc, bool on);

// Where to time cuBLASLt's candidates: the operands of one real call, ready
// on `stream` (any values do; the call's own GEMM overwrites D after), the
// workspace, and a host wait for `stream` that gives up at the call's deadline.
struct GemmTrial {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
  std::function<Status()> wait;
};

// An algorithm for D = op(A) op(B) (C = D) within `workspace_bytes`: cuBLASLt's
// first heuristic choice, or with `trial` the fastest of its first
// kTimedCandidates, timed on trial's operands (as XLA autotunes its GEMMs).
// `what` names the GEMM in the error when there is none.
Status PickAlgorithm(cublasLtHandle_t lt, const LtMatmulDesc& desc, const LtLayout& a,
                     const LtLayout& b, const LtLayout& d, size_t workspace_bytes,
                     const std::string& what, const GemmTrial* trial,
                     cublasLtMatmulAlgo_t* algo, size_t* needs);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CUBLASLT_H_
