// The FFI boundary: Status -> ffi::Error, and FfiGuard, which every handler
// body runs inside so that no C++ exception reaches XLA (an exception through
// the C ABI would terminate the process). Header-only and free of CUDA, so the
// translation is unit-tested on any machine.
#ifndef JAX_COMM_GEMM_FFI_STATUS_H_
#define JAX_COMM_GEMM_FFI_STATUS_H_

#include <utility>

#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_comm_gemm {

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

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_FFI_STATUS_H_
