// How the project calls CUDA, NCCL, cuBLASLt and cuBLASMp: Status, the error
// value passed up to the FFI boundary (handlers.h) or to Python, carrying the
// library's own words so a failure reads as it would in C; the JCG_* macros
// that return it early; the RAII owners of the libraries' handles; and the
// host's waits and durations. Header-only and free of library state, so the
// CPU tests include it without linking any library.
#ifndef JAX_COMM_GEMM_LIBRARY_H_
#define JAX_COMM_GEMM_LIBRARY_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include <cublasLt.h>
#include <cublasmp.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

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

// A library that refuses a call from its arguments alone (NOT_SUPPORTED,
// INVALID_VALUE) refuses it alike on every rank, before any communication:
// the group stays in step, so this is no reason to abort it.
inline Status LibraryRejection(const std::string& call, const std::string& detail) {
  return Status::FailedPrecondition(CallName(call) + " failed: " + detail);
}

// "cudaErrorInvalidValue: invalid argument".
inline std::string CudaDetail(const char* name, const char* text) {
  return std::string(name != nullptr ? name : "cudaError") + ": " + (text != nullptr ? text : "");
}

// NCCL's status string, then the communicator's own last error (the specific
// reason) when NCCL has one.
inline std::string NcclDetail(const char* text, const char* last_error) {
  std::string out = text != nullptr ? text : "unknown NCCL error";
  if (last_error != nullptr && *last_error != '\0') out += std::string(" (") + last_error + ")";
  return out;
}

// cuBLASMp's status string, or the number when the library has no string for it.
inline std::string CublasMpDetail(const char* text, int status) {
  return text != nullptr ? std::string(text) : "cuBLASMp status " + std::to_string(status);
}

inline std::string CudaErrorDetail(cudaError_t e) {
  return CudaDetail(cudaGetErrorName(e), cudaGetErrorString(e));
}
inline std::string NcclErrorDetail(ncclResult_t r, ncclComm_t comm) {
  return NcclDetail(ncclGetErrorString(r), ncclGetLastError(comm));
}
inline Status CudaError(const char* call, cudaError_t e) {
  return LibraryFailure(call, CudaErrorDetail(e));
}
inline Status NcclError(const char* call, ncclResult_t r, ncclComm_t comm = nullptr) {
  return LibraryFailure(call, NcclErrorDetail(r, comm));
}
inline Status CublasMpError(const char* call, cublasMpStatus_t s) {
  const std::string detail = CublasMpDetail(cublasMpGetStatusString(s), static_cast<int>(s));
  const bool rejected = s == CUBLASMP_STATUS_NOT_SUPPORTED || s == CUBLASMP_STATUS_INVALID_VALUE;
  return rejected ? LibraryRejection(call, detail) : LibraryFailure(call, detail);
}
inline Status CublasLtError(const char* call, cublasStatus_t s) {
  const std::string detail =
      std::string(cublasLtGetStatusName(s)) + ": " + cublasLtGetStatusString(s);
  const bool rejected = s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE;
  return rejected ? LibraryRejection(call, detail) : LibraryFailure(call, detail);
}

#define JCG_RETURN_IF_ERROR(expr)             \
  do {                                        \
    ::jax_comm_gemm::Status status_ = (expr); \
    if (!status_.ok()) return status_;        \
  } while (0)

// Calls a library function; on any result but `ok`, returns to_status(its text, result).
#define JCG_LIBRARY_CALL_(type, ok, to_status, text, call)                 \
  do {                                                                     \
    const type result_ = (call);                                           \
    if (result_ != (ok)) return ::jax_comm_gemm::to_status(text, result_); \
  } while (0)
#define JCG_CUDA(call) JCG_LIBRARY_CALL_(cudaError_t, cudaSuccess, CudaError, #call, call)
#define JCG_NCCL(call) JCG_LIBRARY_CALL_(ncclResult_t, ncclSuccess, NcclError, #call, call)
#define JCG_CUBLASMP(call) \
  JCG_LIBRARY_CALL_(cublasMpStatus_t, CUBLASMP_STATUS_SUCCESS, CublasMpError, #call, call)
#define JCG_CUBLASLT(call) \
  JCG_LIBRARY_CALL_(cublasStatus_t, CUBLAS_STATUS_SUCCESS, CublasLtError, #call, call)

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

// Sets an attribute of a cuBLASLt or cuBLASMp matmul descriptor to `value`.
template <typename Desc, typename Attribute, typename T>
Status SetAttribute(Desc desc, Attribute attribute, const T& value) {
  if constexpr (std::is_same_v<Desc, cublasLtMatmulDesc_t>) {
    JCG_CUBLASLT(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
  } else {
    JCG_CUBLASMP(cublasMpMatmulDescriptorSetAttribute(desc, attribute, &value, sizeof(value)));
  }
  return Status();
}

// RAII owners: each frees its handle exactly once and ignores the destroy's
// error (it happens only at shutdown, where nothing can be done about it).
// After an abort a context leaks them instead (release(): Context::Abandon).
template <typename Handle, auto Destroy>
struct Destroyer {
  void operator()(Handle h) const {
    if (h != nullptr) (void)Destroy(h);
  }
};
template <typename Handle, auto Destroy>
using Owned = std::unique_ptr<std::remove_pointer_t<Handle>, Destroyer<Handle, Destroy>>;

using NcclComm = Owned<ncclComm_t, ncclCommDestroy>;
using CudaStream = Owned<cudaStream_t, cudaStreamDestroy>;
using CudaEvent = Owned<cudaEvent_t, cudaEventDestroy>;
using DeviceBuffer = Owned<void*, cudaFree>;
using PinnedHostBuffer = Owned<void*, cudaFreeHost>;  // for copies that must not block the host
using CublasMpHandle = Owned<cublasMpHandle_t, cublasMpDestroy>;
using Grid = Owned<cublasMpGrid_t, cublasMpGridDestroy>;
using MatrixDescriptor = Owned<cublasMpMatrixDescriptor_t, cublasMpMatrixDescriptorDestroy>;
using MatmulDescriptor = Owned<cublasMpMatmulDescriptor_t, cublasMpMatmulDescriptorDestroy>;
using LtHandle = Owned<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;
using LtTransformDesc = Owned<cublasLtMatrixTransformDesc_t, cublasLtMatrixTransformDescDestroy>;

using Clock = std::chrono::steady_clock;

// `seconds` as a Clock duration, clamped to [0, 10^8 s] so that a huge or
// infinite timeout means "wait very long", not an overflow.
inline Clock::duration SecondsToDuration(double seconds) {
  const double clamped = seconds > 0 ? std::min(seconds, 1e8) : 0.0;  // NaN -> 0
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(clamped));
}

// "300 s", "2.5 s": whole seconds from 100 on, else 3 significant digits.
inline std::string FormatSeconds(double seconds) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), seconds >= 100 ? "%.0f s" : "%.3g s", seconds);
  return buffer;
}

// cudaSetDevice for the current thread, restored on scope exit.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    int now = -1;
    if (entered_ && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      (void)cudaSetDevice(previous_);
    }
  }
  Status Enter(int device) {
    JCG_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) JCG_CUDA(cudaSetDevice(device));
    entered_ = true;
    return Status();
  }

 private:
  int previous_ = -1;
  bool entered_ = false;
};

// Polls `event` until it completes (OK), `deadline` passes (DeadlineExceeded,
// empty message), `give_up` turns true (Aborted, empty message) or CUDA
// reports an error (Internal): cudaEventSynchronize would block for good on a
// peer that does not answer. Yields at first (most waits are short), then
// sleeps with a growing pause of at most 1 ms, so a long wait costs no CPU.
inline Status WaitForEvent(cudaEvent_t event, Clock::time_point deadline,
                           const std::atomic<bool>& give_up) {
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(200);
  std::chrono::microseconds pause(10);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return Status();
    if (e != cudaErrorNotReady) return CudaError("cudaEventQuery", e);
    if (give_up.load()) return Status::Aborted(std::string());
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return Status::DeadlineExceeded(std::string());
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_LIBRARY_H_
