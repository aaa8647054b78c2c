// The names and numbers that Python and C++ must agree on: the FFI target
// names, the layouts of the gathered operand and the algorithms. Both nanobind
// modules include this header (_constants exports it to Python, whose own
// table a test compares with it), so each value is written down once. Header
// constants only: including it links nothing, so _constants loads on a
// machine without CUDA.
#ifndef JAX_COMM_GEMM_CONSTANTS_H_
#define JAX_COMM_GEMM_CONSTANTS_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include <cublasmp.h>

namespace jax_comm_gemm {

// The names Python registers the handlers under (jax.ffi.register_ffi_target).
inline constexpr char kAllGatherMatmulTarget[] = "jax_comm_gemm_all_gather_matmul";
inline constexpr char kMatmulReduceScatterTarget[] = "jax_comm_gemm_matmul_reduce_scatter";
// The FP8 twins of the first two: FP8 x and w with their scales (MatmulCall).
inline constexpr char kFp8AllGatherMatmulTarget[] = "jax_comm_gemm_fp8_all_gather_matmul";
inline constexpr char kFp8MatmulReduceScatterTarget[] =
    "jax_comm_gemm_fp8_matmul_reduce_scatter";
// The FP8 GEMM with scale pointers and a timed algorithm (fp8_gemm.cc), and the
// name its FFI state type is registered under.
inline constexpr char kFp8GemmTarget[] = "jax_comm_gemm_fp8_gemm";
inline constexpr char kFp8GemmStateType[] = "jax_comm_gemm_fp8_gemm_state";

// Where cuBLASMp leaves the gathered operand B of an AllGather+GEMM in its
// workspace. kFront: at offset 0 (documented for cuBLASMp >= 0.11.0).
// kTail: after its cuBLASLt workspaces, ending TailPadding(nranks) bytes before
// the end (measured for 0.10.0). Python picks one and verifies it once per context.
enum class GatheredLayout : int64_t { kFront = 0, kTail = 1 };

// What cuBLASMp 0.10 leaves after the gathered operand at the end of the
// workspace: 16 bytes at 2 and 4 ranks, 32 at 8 (measured, bf16 and FP8 alike;
// the workspace it asks for grows by the same bytes), as an int32 per rank
// rounded up to 16 bytes would be. A group size where this does not hold fails
// the layout self-test, which turns reuse off there
// (docs/design.md#the-gathered-operand-and-its-layout).
constexpr size_t TailPadding(int nranks) {
  return (4 * static_cast<size_t>(nranks < 1 ? 1 : nranks) + 15) / 16 * 16;
}

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

// The AllGather+GEMM / GEMM+ReduceScatter algorithms the project offers, by
// the names Python uses: two of cuBLASMp's, numbered as cublasmp.h's enum,
// and the project's own (pipelined.h), numbered clear of that enum.
// cuBLASMp's others (split_multicast, atomic_p2p, atomic_multicast,
// no_overlap) are not offered: nothing selects them and no user gains by
// choosing them (docs/design.md#options-removed-and-why). FUSED is
// GEMM+AllReduce only.
struct AlgorithmName {
  const char* name;
  int64_t algorithm;
};

inline constexpr int64_t kPipelinedCeAlgorithm = 101;

inline constexpr AlgorithmName kAlgorithms[] = {
    {"default", CUBLASMP_MATMUL_ALGO_TYPE_DEFAULT},
    {"split_p2p", CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P},
    {"pipelined_ce", kPipelinedCeAlgorithm},
};

// The name of algorithm `number`, or null if the project does not offer it.
inline const char* AlgorithmNameOf(int64_t number) {
  for (const AlgorithmName& a : kAlgorithms) {
    if (a.algorithm == number) return a.name;
  }
  return nullptr;
}

// Whether algorithm `number` is the project's own rather than cuBLASMp's.
inline bool IsPipelined(int64_t number) { return number == kPipelinedCeAlgorithm; }

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONSTANTS_H_
