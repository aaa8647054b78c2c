// Status: the error value passed up from CUDA, NCCL and cuBLASMp calls to the
// FFI boundary (an ffi::Error, see ffi_status.h) or to Python (an exception).
// It carries the library's own status string, so a failure reads as it would in
// C. Plain C++: the formatting here is unit-tested without any GPU library;
// library_status.h feeds it the libraries' strings.
#ifndef JAX_COMM_GEMM_STATUS_H_
#define JAX_COMM_GEMM_STATUS_H_

#include <exception>
#include <new>
#include <string>
#include <utility>

namespace jax_comm_gemm {

class Status {
 public:
  // For a comm-GEMM call, kInvalidArgument and kFailedPrecondition mean a
  // check that every rank makes alike, before any collective of the call, so
  // the group is still in step; the other errors may leave it out of step
  // (Context::Run aborts the context on them).
  enum class Code {
    kOk,
    kInvalidArgument,
    kFailedPrecondition,
    kDeadlineExceeded,
    kAborted,
    kResourceExhausted,
    kInternal,
  };

  Status() = default;
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {Code::kFailedPrecondition, std::move(m)};
  }
  static Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
  static Status Aborted(std::string m) { return {Code::kAborted, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {Code::kResourceExhausted, std::move(m)};
  }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string& message() { return message_; }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// "cublasMpMatmul(handle, ...)" -> "cublasMpMatmul": the name is what a reader needs.
inline std::string CallName(const std::string& call) { return call.substr(0, call.find('(')); }

// "<call> failed: <detail>", the one shape of every library error.
inline Status LibraryFailure(const std::string& call, const std::string& detail) {
  return Status::Internal(CallName(call) + " failed: " + detail);
}

// A library that refuses a call from its arguments alone (cuBLASMp's
// NOT_SUPPORTED, INVALID_VALUE) refuses it alike on every rank, before any
// communication: the group stays in step, so this is no reason to abort it.
inline Status LibraryRejection(const std::string& call, const std::string& detail) {
  return Status::FailedPrecondition(CallName(call) + " failed: " + detail);
}

// The detail of a CUDA error: "cudaErrorInvalidValue: invalid argument".
inline std::string CudaDetail(const char* name, const char* text) {
  return std::string(name != nullptr ? name : "cudaError") + ": " + (text != nullptr ? text : "");
}

// The detail of an NCCL error: its status string, then the communicator's own
// last error (the specific reason) when NCCL has one.
inline std::string NcclDetail(const char* text, const char* last_error) {
  std::string out = text != nullptr ? text : "unknown NCCL error";
  if (last_error != nullptr && *last_error != '\0') out += std::string(" (") + last_error + ")";
  return out;
}

// The detail of a cuBLASMp error: its status string, or the number when the
// library has no string for it.
inline std::string CublasMpDetail(const char* text, int status) {
  return text != nullptr ? std::string(text) : "cuBLASMp status " + std::to_string(status);
}

// Runs `body` (returning Status) and turns any exception it throws into a
// Status, so that none crosses a C boundary (an FFI handler, a thread's entry).
// `where` names the entry point in the message.
template <typename Body>
Status CatchExceptions(const char* where, Body&& body) noexcept {
  try {
    try {
      return body();
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted(std::string(where) + ": out of host memory");
    } catch (const std::exception& e) {
      return Status::Internal(std::string(where) + ": " + e.what());
    } catch (...) {
      return Status::Internal(std::string(where) + ": unknown C++ exception");
    }
  } catch (...) {
    // Building the message itself failed (no memory left): an empty message
    // needs no allocation.
    return Status::ResourceExhausted(std::string());
  }
}

}  // namespace jax_comm_gemm

#define JCG_RETURN_IF_ERROR(expr)               \
  do {                                          \
    ::jax_comm_gemm::Status status_ = (expr);   \
    if (!status_.ok()) return status_;          \
  } while (0)

#endif  // JAX_COMM_GEMM_STATUS_H_
