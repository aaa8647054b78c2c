// The element types and shapes of the buffers XLA hands the handlers, in CUDA's
// terms, with the errors a caller sees for a wrong one. Shared by every handler
// (handlers.cc, fp8_gemm.cc), so each rule is written once.
#ifndef JAX_COMM_GEMM_FFI_TYPES_H_
#define JAX_COMM_GEMM_FFI_TYPES_H_

#include <string>

#include <library_types.h>

#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_comm_gemm {

// bfloat16, float16 or float32: the comm-GEMMs' operands, and every GEMM's result.
inline Status WideType(xla::ffi::DataType t, const char* what, cudaDataType_t* out) {
  switch (t) {
    case xla::ffi::DataType::BF16: *out = CUDA_R_16BF; return Status();
    case xla::ffi::DataType::F16: *out = CUDA_R_16F; return Status();
    case xla::ffi::DataType::F32: *out = CUDA_R_32F; return Status();
    default:
      return Status::InvalidArgument(std::string(what) + " must be bfloat16, float16 or float32");
  }
}

// float8_e4m3fn or float8_e5m2: an FP8 GEMM's operands.
inline Status Fp8Type(xla::ffi::DataType t, const char* what, cudaDataType_t* out) {
  switch (t) {
    case xla::ffi::DataType::F8E4M3FN: *out = CUDA_R_8F_E4M3; return Status();
    case xla::ffi::DataType::F8E5M2: *out = CUDA_R_8F_E5M2; return Status();
    default:
      return Status::InvalidArgument(std::string(what) + " must be float8_e4m3fn or float8_e5m2");
  }
}

// Hopper's FP8 tensor cores take E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3.
inline Status CheckFp8Pair(cudaDataType_t a, cudaDataType_t b) {
  if (a == CUDA_R_8F_E5M2 && b == CUDA_R_8F_E5M2) {
    return Status::InvalidArgument("cuBLASLt has no FP8 GEMM of two float8_e5m2 operands");
  }
  return Status();
}

// "[2, 3]".
inline std::string Dims(xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_FFI_TYPES_H_
