// The names and numbers that Python and C++ must agree on: the FFI target
// names and the layouts of the gathered operand (algorithms.h has the
// algorithms). Both nanobind modules include this header (_constants exports
// it to Python, whose own table a test compares with it), so each value is
// written down once.
// Plain C++ on purpose: _constants must load on a machine without CUDA.
#ifndef JAX_COMM_GEMM_CONSTANTS_H_
#define JAX_COMM_GEMM_CONSTANTS_H_

#include <cstdint>
#include <optional>

namespace jax_comm_gemm {

// The names Python registers the handlers under (jax.ffi.register_ffi_target).
inline constexpr char kAllGatherMatmulTarget[] = "jax_comm_gemm_all_gather_matmul";
inline constexpr char kMatmulReduceScatterTarget[] = "jax_comm_gemm_matmul_reduce_scatter";
// The FP8 twins of the first two: FP8 x and w with their scales (plan.h).
inline constexpr char kFp8AllGatherMatmulTarget[] = "jax_comm_gemm_fp8_all_gather_matmul";
inline constexpr char kFp8MatmulReduceScatterTarget[] =
    "jax_comm_gemm_fp8_matmul_reduce_scatter";
// The FP8 GEMM with scale pointers and a timed algorithm (fp8_gemm.h), and the
// name its FFI state type is registered under.
inline constexpr char kFp8GemmTarget[] = "jax_comm_gemm_fp8_gemm";
inline constexpr char kFp8GemmStateType[] = "jax_comm_gemm_fp8_gemm_state";

// Where cuBLASMp leaves the gathered operand B of an AllGather+GEMM in its
// workspace. kFront: at offset 0 (documented for cuBLASMp >= 0.11.0).
// kTail: after its cuBLASLt workspaces, ending 16 bytes before the end
// (measured for 0.10.0). Python picks one and verifies it once per context.
enum class GatheredLayout : int64_t { kFront = 0, kTail = 1 };

struct LayoutName {
  const char* name;
  GatheredLayout layout;
};
inline constexpr LayoutName kLayouts[] = {
    {"front", GatheredLayout::kFront},
    {"tail", GatheredLayout::kTail},
};

// The layout a custom call's `layout` attribute names, if any.
inline std::optional<GatheredLayout> LayoutByNumber(int64_t number) {
  for (const LayoutName& l : kLayouts) {
    if (static_cast<int64_t>(l.layout) == number) return l.layout;
  }
  return std::nullopt;
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONSTANTS_H_
