// Status: the error value passed up from CUDA, NCCL and cuBLASMp calls to the
// FFI boundary (an ffi::Error) or to Python (a RuntimeError). It carries the
// library's own status string, so a failure reads the same as it would in C.
#ifndef JAX_COMM_GEMM_STATUS_H_
#define JAX_COMM_GEMM_STATUS_H_

#include <string>
#include <utility>

#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace jax_comm_gemm {

class Status {
 public:
  enum class Code { kOk, kInvalidArgument, kFailedPrecondition, kInternal };

  Status() = default;
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// "cublasMpMatmul(handle, ...)" -> "cublasMpMatmul": the name is what a reader needs.
inline std::string CallName(const char* call) {
  std::string s(call);
  return s.substr(0, s.find('('));
}

inline Status CudaError(const char* call, cudaError_t e) {
  return Status::Internal(CallName(call) + " failed: " + cudaGetErrorName(e) + ": " +
                          cudaGetErrorString(e));
}

inline Status NcclError(const char* call, ncclResult_t r, ncclComm_t comm = nullptr) {
  std::string m = CallName(call) + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  return Status::Internal(std::move(m));
}

inline Status CublasMpError(const char* call, cublasMpStatus_t s) {
  const char* text = cublasMpGetStatusString(s);
  return Status::Internal(CallName(call) + " failed: " +
                          (text != nullptr ? text : "cuBLASMp status " + std::to_string(s)));
}

}  // namespace jax_comm_gemm

#define JCG_RETURN_IF_ERROR(expr)               \
  do {                                          \
    ::jax_comm_gemm::Status status_ = (expr);   \
    if (!status_.ok()) return status_;          \
  } while (0)

#define JCG_CUDA(call)                                                    \
  do {                                                                    \
    cudaError_t err_ = (call);                                            \
    if (err_ != cudaSuccess) return ::jax_comm_gemm::CudaError(#call, err_); \
  } while (0)

#define JCG_NCCL(call)                                                         \
  do {                                                                         \
    ncclResult_t res_ = (call);                                                \
    if (res_ != ncclSuccess) return ::jax_comm_gemm::NcclError(#call, res_);   \
  } while (0)

#define JCG_CUBLASMP(call)                                                           \
  do {                                                                               \
    cublasMpStatus_t st_ = (call);                                                   \
    if (st_ != CUBLASMP_STATUS_SUCCESS) return ::jax_comm_gemm::CublasMpError(#call, st_); \
  } while (0)

#endif  // JAX_COMM_GEMM_STATUS_H_
