// The names and numbers that Python and C++ must agree on: the FFI target
// names, the layouts of the gathered operand and the fences. Both nanobind
// modules include this header (_constants exports it to Python, whose own
// table a test compares with it), so each value is written down once.
// Plain C++ on purpose: _constants must load on a machine without CUDA.
#ifndef JAX_COMM_GEMM_CONSTANTS_H_
#define JAX_COMM_GEMM_CONSTANTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace jax_comm_gemm {

// The names Python registers the handlers under (jax.ffi.register_ffi_target).
inline constexpr char kAllGatherMatmulTarget[] = "jax_comm_gemm_all_gather_matmul";
inline constexpr char kMatmulReduceScatterTarget[] = "jax_comm_gemm_matmul_reduce_scatter";
// The AllGather+GEMM that also computes the weight gradient (weight_gradient.h).
inline constexpr char kAllGatherMatmulWeightGradientTarget[] =
    "jax_comm_gemm_all_gather_matmul_weight_gradient";

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

// How a call is ordered against the XLA work around it and against the
// peers' next calls (JAX_COMM_GEMM_FENCE, which Python reads and passes to
// connect()). cuBLASMp's AllGather+GEMM writes this rank's shard into each
// peer's workspace, and nothing in a call keeps a peer's *next* call from
// doing so while this rank still reads its workspace (the copy of the gathered
// operand, cuBLASMp's own GEMMs on it). Only a cross-rank order after the call
// removes that: with one process per GPU (GPU run 29), kNone and kOwnStream
// were wrong in 88 of 90 MLP runs each, kIsolated right in 500 of 500, and the
// project's pipelined algorithms, whose NCCL transfers wait for the receiver,
// right in 100 of 100 under kNone. Tallies: README.md, "Ordering against XLA".
enum class Fence {
  kIsolated,   // kOwnStream, then a barrier on the group (the default)
  kOwnStream,  // on the context's stream, joined to XLA's by events; unsafe
  kBarrier,    // on XLA's stream, a 1-element ncclAllReduce after the call
  kHost,       // on XLA's stream, the host waits for it (slowest); unsafe: a
               // peer's host may return first and start its next call
  kNone,       // on XLA's stream, nothing else; unsafe
};

struct FenceName {
  const char* name;
  Fence fence;
};
// The default first.
inline constexpr FenceName kFences[] = {
    {"isolated", Fence::kIsolated}, {"own_stream", Fence::kOwnStream},
    {"barrier", Fence::kBarrier},   {"host", Fence::kHost},
    {"none", Fence::kNone},
};

inline std::optional<Fence> FenceByName(std::string_view name) {
  for (const FenceName& f : kFences) {
    if (name == f.name) return f.fence;
  }
  return std::nullopt;
}

// "isolated, own_stream, ...": for error messages.
inline std::string FenceList() {
  std::string out;
  for (const FenceName& f : kFences) out += (out.empty() ? "" : ", ") + std::string(f.name);
  return out;
}

// The layout a custom call's `layout` attribute names, if any.
inline std::optional<GatheredLayout> LayoutByNumber(int64_t number) {
  for (const LayoutName& l : kLayouts) {
    if (static_cast<int64_t>(l.layout) == number) return l.layout;
  }
  return std::nullopt;
}

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_CONSTANTS_H_
