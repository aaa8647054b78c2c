// PerDevice<T>: one T per device ordinal, made on first use and kept for the
// owner's lifetime. An FFI state belongs to an executable, and one process may
// run an executable on every GPU it drives: what is made on and for one device
// (a cuBLASLt handle, its workspace, an algorithm timed there) must not serve
// another. Thread-safe; the T's themselves are the caller's to guard (each has
// its own mutex where calls may overlap). Free of CUDA, so it is unit-tested on
// any machine (tests/cpp/test_per_device.cc).
#ifndef JAX_COMM_GEMM_PER_DEVICE_H_
#define JAX_COMM_GEMM_PER_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace jax_comm_gemm {

template <typename T>
class PerDevice {
 public:
  // The T of `device`, made (default-constructed) at its first use. The
  // pointer stays valid as long as this PerDevice.
  T* Get(int32_t device) {
    std::lock_guard<std::mutex> lock(mu_);
    std::unique_ptr<T>& slot = states_[device];
    if (!slot) slot = std::make_unique<T>();
    return slot.get();
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return states_.size();
  }

 private:
  mutable std::mutex mu_;
  std::map<int32_t, std::unique_ptr<T>> states_;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_PER_DEVICE_H_
