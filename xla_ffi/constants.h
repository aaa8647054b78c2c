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

// How a call is ordered against the XLA work around it (JAX_COMM_GEMM_FENCE,
// which Python reads and passes to connect()). With cuBLASMp enqueued straight
// on XLA's compute stream, XLA work around a fused call read wrong data on the
// 2xH200 test machine (1 MLP run in 8 in session 2, 142 of 150 with one
// process per GPU in GPU run 19). Each fence below but kNone (and kSplitHandle,
// not yet run) removed it there (0 of 500 with kIsolated). kOwnStream, which
// orders nothing across ranks either, was right in 48 of 48 runs, so the
// peer's early write into this rank's workspace is not needed to explain it;
// what sets kNone apart is that cublasMpSetStream moves the handle off the
// stream it was created on for every call (kSplitHandle tests that reading).
// Traces and tallies: README.md, "Ordering against XLA".
enum class Fence {
  kIsolated,   // kOwnStream, then a barrier on the group (the default)
  kOwnStream,  // cuBLASMp on the context's stream, joined to XLA's by events
  kBarrier,    // on XLA's stream, a 1-element ncclAllReduce after the call
  kHost,       // on XLA's stream, then wait for it on the host (slowest)
  kNone,       // on XLA's stream, nothing else; for that investigation only
  // As kOwnStream, but cuBLASMp's handle is created on a stream of its own and
  // moved to the call's stream by cublasMpSetStream, as kNone moves it to XLA's:
  // tells whether the race of kNone comes from cuBLASMp's ordering being tied
  // to its handle's first stream. For that investigation only.
  kSplitHandle,
};

struct FenceName {
  const char* name;
  Fence fence;
};
// The default first.
inline constexpr FenceName kFences[] = {
    {"isolated", Fence::kIsolated}, {"own_stream", Fence::kOwnStream},
    {"barrier", Fence::kBarrier},   {"host", Fence::kHost},
    {"none", Fence::kNone},         {"split_handle", Fence::kSplitHandle},
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
