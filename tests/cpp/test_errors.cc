// Error translation: Status codes to FFI error codes, exceptions to errors
// (none may cross the FFI boundary), and the library messages' shape.
#include <new>
#include <stdexcept>
#include <string>

#include "check.h"
#include "handlers.h"
#include "library.h"

namespace ffi = xla::ffi;
using jax_comm_gemm::CallName;
using jax_comm_gemm::CatchExceptions;
using jax_comm_gemm::CublasMpDetail;
using jax_comm_gemm::CudaDetail;
using jax_comm_gemm::FfiCode;
using jax_comm_gemm::FfiGuard;
using jax_comm_gemm::LibraryFailure;
using jax_comm_gemm::LibraryRejection;
using jax_comm_gemm::NcclDetail;
using jax_comm_gemm::Status;
using jax_comm_gemm::ToFfi;
using Code = Status::Code;

namespace {

bool Is(const ffi::Error& e, ffi::ErrorCode code) { return e.errc() == code; }

}  // namespace

TEST(StatusCodesMapToFfiCodes) {
  CHECK(FfiCode(Code::kOk) == ffi::ErrorCode::kOk);
  CHECK(FfiCode(Code::kInvalidArgument) == ffi::ErrorCode::kInvalidArgument);
  CHECK(FfiCode(Code::kFailedPrecondition) == ffi::ErrorCode::kFailedPrecondition);
  CHECK(FfiCode(Code::kDeadlineExceeded) == ffi::ErrorCode::kDeadlineExceeded);
  CHECK(FfiCode(Code::kAborted) == ffi::ErrorCode::kAborted);
  CHECK(FfiCode(Code::kResourceExhausted) == ffi::ErrorCode::kResourceExhausted);
  CHECK(FfiCode(Code::kInternal) == ffi::ErrorCode::kInternal);
}

TEST(ToFfiKeepsCodeAndMessage) {
  CHECK(ToFfi(Status()).success());
  const ffi::Error e = ToFfi(Status::Aborted("the communicator was aborted"));
  CHECK(e.failure());
  CHECK(Is(e, ffi::ErrorCode::kAborted));
  CHECK_EQ(e.message(), std::string("the communicator was aborted"));
}

TEST(GuardPassesStatusThrough) {
  CHECK(FfiGuard("x", [] { return Status(); }).success());
  const ffi::Error e = FfiGuard("x", [] { return Status::InvalidArgument("bad shape"); });
  CHECK(Is(e, ffi::ErrorCode::kInvalidArgument));
  CHECK_EQ(e.message(), std::string("bad shape"));
}

TEST(BadAllocBecomesResourceExhausted) {
  const ffi::Error e = FfiGuard("jax_comm_gemm_all_gather_matmul", []() -> Status {
    throw std::bad_alloc();
  });
  CHECK(Is(e, ffi::ErrorCode::kResourceExhausted));
  CHECK_EQ(e.message(), std::string("jax_comm_gemm_all_gather_matmul: out of host memory"));
}

TEST(StdExceptionBecomesInternalWithItsMessage) {
  const ffi::Error e = FfiGuard("handler", []() -> Status {
    throw std::out_of_range("map::at");
  });
  CHECK(Is(e, ffi::ErrorCode::kInternal));
  CHECK_EQ(e.message(), std::string("handler: map::at"));
}

TEST(AnyOtherExceptionBecomesInternal) {
  const Status s = CatchExceptions("thread", []() -> Status { throw 42; });
  CHECK(s.code() == Code::kInternal);
  CHECK_EQ(s.message(), std::string("thread: unknown C++ exception"));
}

TEST(CallNameDropsTheArguments) {
  CHECK_EQ(CallName("cublasMpMatmul(handle_.get(), plan.matmul.get(), ...)"),
           std::string("cublasMpMatmul"));
  CHECK_EQ(CallName("ncclCommInitRank"), std::string("ncclCommInitRank"));
}

TEST(ARejectedCallIsNoReasonToAbort) {
  const Status s = LibraryRejection("cublasMpMatmul(handle, desc, m)",
                                    CublasMpDetail("the requested functionality is not supported", 15));
  CHECK(s.code() == Status::Code::kFailedPrecondition);
  CHECK_EQ(s.message(), std::string("cublasMpMatmul failed: the requested functionality is not "
                                    "supported"));
}

TEST(LibraryFailuresCarryTheLibrarysWords) {
  const Status cuda = LibraryFailure("cudaMemcpyAsync(dst, src, n, kind, s)",
                                     CudaDetail("cudaErrorInvalidValue", "invalid argument"));
  CHECK(cuda.code() == Code::kInternal);
  CHECK_EQ(cuda.message(),
           std::string("cudaMemcpyAsync failed: cudaErrorInvalidValue: invalid argument"));

  const Status nccl = LibraryFailure(
      "ncclAllReduce", NcclDetail("remote process exited or there was a network error",
                                  "socket recv failed"));
  CHECK_EQ(nccl.message(), std::string("ncclAllReduce failed: remote process exited or there "
                                       "was a network error (socket recv failed)"));
  CHECK_EQ(NcclDetail("invalid usage", ""), std::string("invalid usage"));
  CHECK_EQ(NcclDetail("invalid usage", nullptr), std::string("invalid usage"));

  CHECK_EQ(CublasMpDetail("CUBLASMP_STATUS_INVALID_VALUE", 3),
           std::string("CUBLASMP_STATUS_INVALID_VALUE"));
  CHECK_EQ(CublasMpDetail(nullptr, 7), std::string("cuBLASMp status 7"));
}
