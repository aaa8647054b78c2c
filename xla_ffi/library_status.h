// Turns CUDA, NCCL, cuBLASLt and cuBLASMp return codes into Status values carrying the
// libraries' own strings, and the JCG_CUDA / JCG_NCCL / JCG_CUBLASMP macros
// that return early on failure. The formatting lives in status.h (tested
// without the libraries); this header only asks each library for its words.
#ifndef JAX_COMM_GEMM_LIBRARY_STATUS_H_
#define JAX_COMM_GEMM_LIBRARY_STATUS_H_

#include <cublasLt.h>
#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "status.h"

namespace jax_comm_gemm {

inline std::string CudaErrorDetail(cudaError_t e) {
  return CudaDetail(cudaGetErrorName(e), cudaGetErrorString(e));
}

inline Status CudaError(const char* call, cudaError_t e) {
  return LibraryFailure(call, CudaErrorDetail(e));
}

inline std::string NcclErrorDetail(ncclResult_t r, ncclComm_t comm) {
  return NcclDetail(ncclGetErrorString(r), ncclGetLastError(comm));
}

inline Status NcclError(const char* call, ncclResult_t r, ncclComm_t comm = nullptr) {
  return LibraryFailure(call, NcclErrorDetail(r, comm));
}

inline Status CublasMpError(const char* call, cublasMpStatus_t s) {
  const std::string detail = CublasMpDetail(cublasMpGetStatusString(s), static_cast<int>(s));
  if (s == CUBLASMP_STATUS_NOT_SUPPORTED || s == CUBLASMP_STATUS_INVALID_VALUE) {
    return LibraryRejection(call, detail);
  }
  return LibraryFailure(call, detail);
}

inline Status CublasLtError(const char* call, cublasStatus_t s) {
  const std::string detail = std::string(cublasLtGetStatusName(s)) + ": " +
                             cublasLtGetStatusString(s);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE) {
    return LibraryRejection(call, detail);
  }
  return LibraryFailure(call, detail);
}

}  // namespace jax_comm_gemm

#define JCG_CUDA(call)                                                       \
  do {                                                                       \
    cudaError_t err_ = (call);                                               \
    if (err_ != cudaSuccess) return ::jax_comm_gemm::CudaError(#call, err_); \
  } while (0)

#define JCG_NCCL(call)                                                       \
  do {                                                                       \
    ncclResult_t res_ = (call);                                              \
    if (res_ != ncclSuccess) return ::jax_comm_gemm::NcclError(#call, res_); \
  } while (0)

#define JCG_CUBLASMP(call)                                                                 \
  do {                                                                                     \
    cublasMpStatus_t st_ = (call);                                                         \
    if (st_ != CUBLASMP_STATUS_SUCCESS) return ::jax_comm_gemm::CublasMpError(#call, st_); \
  } while (0)

#define JCG_CUBLASLT(call)                                                               \
  do {                                                                                   \
    cublasStatus_t st_ = (call);                                                         \
    if (st_ != CUBLAS_STATUS_SUCCESS) return ::jax_comm_gemm::CublasLtError(#call, st_); \
  } while (0)

#endif  // JAX_COMM_GEMM_LIBRARY_STATUS_H_
