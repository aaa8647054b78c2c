// The FFI boundary, shared by the handler files (handlers.cc, fp8_gemm.cc) and
// module.cc: the handler symbols, which Python registers under constants.h's
// target names for platform "CUDA" (the FP8 GEMM has two stages and a state
// type); FfiGuard, inside which every handler body runs, so that no C++
// exception reaches XLA (one through the C ABI would end the process); and the
// buffers' element types in CUDA's terms, with the errors a caller sees for a
// wrong one. Free of CUDA calls, so the translation is unit-tested on any machine.
#ifndef JAX_COMM_GEMM_HANDLERS_H_
#define JAX_COMM_GEMM_HANDLERS_H_

#include <string>
#include <utility>

#include <library_types.h>

#include "library.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(kAllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8AllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8MatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8GemmInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8GemmExecute);

namespace jax_comm_gemm {

// The FP8 GEMM's state type, for its registration (fp8_gemm.cc).
xla::ffi::TypeId* Fp8GemmStateTypeId();
const XLA_FFI_TypeInfo* Fp8GemmTypeInfo();

inline xla::ffi::ErrorCode FfiCode(Status::Code code) {
  using xla::ffi::ErrorCode;
  switch (code) {
    case Status::Code::kOk: return ErrorCode::kOk;
    case Status::Code::kInvalidArgument: return ErrorCode::kInvalidArgument;
    case Status::Code::kFailedPrecondition: return ErrorCode::kFailedPrecondition;
    case Status::Code::kDeadlineExceeded: return ErrorCode::kDeadlineExceeded;
    case Status::Code::kAborted: return ErrorCode::kAborted;
    case Status::Code::kResourceExhausted: return ErrorCode::kResourceExhausted;
    case Status::Code::kInternal: break;
  }
  return ErrorCode::kInternal;
}

// Takes the status by value and moves its message: no allocation here.
inline xla::ffi::Error ToFfi(Status s) noexcept {
  if (s.ok()) return xla::ffi::Error::Success();
  return xla::ffi::Error(FfiCode(s.code()), std::move(s.message()));
}

// Runs a handler body (returning Status); exceptions become errors.
template <typename Body>
xla::ffi::Error FfiGuard(const char* where, Body&& body) noexcept {
  return ToFfi(CatchExceptions(where, std::forward<Body>(body)));
}

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

// InvalidArgument unless `what`'s dimensions `d` are [rows, cols].
inline Status ExpectShape(const char* what, xla::ffi::AnyBuffer::Dimensions d, int64_t rows,
                          int64_t cols) {
  if (d.size() == 2 && d[0] == rows && d[1] == cols) return Status();
  return Status::InvalidArgument(std::string(what) + " has shape " + Dims(d) + ", expected [" +
                                 std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_HANDLERS_H_
