// The FP8 GEMM of the FP8 layers (jax_comm_gemm/fp8/gemm.py, form "cublaslt"):
//
//   d[m, n] = (a8[m, k] . b8[n, k]^T) * sa * sb
//
// both FP8 operands contracting on their last axis (the TN form Hopper's FP8
// GEMMs take), the inverse scales sa, sb applied by cuBLASLt itself through its
// A/B scale pointers: per tensor (f32 scalars, SCALAR_32F), per row of a and of
// b (f32 vectors of m and n, OUTER_VEC_32F), or per block (a's 1 x 128, b's
// 128 x 128: VEC128_32F, BLK128x128_32F). No output pass, no FP8 transpose,
// and the epilogue scales in f32 before the one rounding to d's type.
//
// XLA's own FP8 GEMM takes cuBLASLt's first heuristic choice, or a Triton
// fusion; this one times cuBLASLt's first candidates on the first call's
// operands (cublaslt.h's PickAlgorithm, as pipelined_ce's block GEMMs do) and
// keeps the fastest for the custom call's lifetime: the
// shapes of one call site never change.
//
// The algorithm, the descriptors and a cuBLASLt handle and the workspace the
// algorithm needs (often none) live in the custom call's FFI state (made at
// instantiation, filled at the first call, freed with the executable): no global state, nothing per call but the
// scale pointers and the GEMM itself. Unlike the collective handlers it is
// command-buffer compatible: XLA may record it into the CUDA graphs it makes
// of a step's GEMMs and fusions (a call outside them would split those graphs).
#ifndef JAX_COMM_GEMM_FP8_GEMM_H_
#define JAX_COMM_GEMM_FP8_GEMM_H_

#include <cstddef>
#include <cstdint>
#include <mutex>

#include <cublasLt.h>
#include <library_types.h>

#include "handles.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_comm_gemm {

inline constexpr int64_t kBlock = 128;  // the side of a scaling block

// What one call site computes: the shapes, the element types and whether the
// scales are vectors. Python checks it before lowering (fp8/gemm.py); the
// handler checks it again against the buffers.
struct Fp8GemmShape {
  int64_t m = 0, n = 0, k = 0;
  cudaDataType_t a_type = CUDA_R_8F_E4M3, b_type = CUDA_R_8F_E4M3, d_type = CUDA_R_16BF;
  // cublasLtMatmulMatrixScale_t of a's and b's scales: both SCALAR_32F, both
  // OUTER_VEC_32F, or VEC128_32F / BLK128x128_32F each (fp8_gemm.cc checks).
  int32_t a_mode = 0, b_mode = 0;
  // cuBLASLt's FP8 fast accumulation: partial sums are not promoted to f32
  // along k (faster, less precise; XLA's default for FP8 dots).
  bool fast_accum = false;

  bool operator==(const Fp8GemmShape& o) const {
    return m == o.m && n == o.n && k == o.k && a_type == o.a_type && b_type == o.b_type &&
           d_type == o.d_type && a_mode == o.a_mode && b_mode == o.b_mode &&
           fast_accum == o.fast_accum;
  }
};

// The cuBLASLt descriptors of one call site and the algorithm picked for it.
struct Fp8GemmPlan {
  Fp8GemmShape shape;
  LtMatmulDesc desc;
  LtLayout a, b, d;  // cuBLASLt's column-major view: A = b8, B = a8, D = d^T
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
};

// The FFI state of one FP8 GEMM custom call (ffi::State): made empty at
// instantiation, planned at the first call.
struct Fp8GemmState {
  static xla::ffi::TypeId id;
  // What the timed candidates may use (cuBLASLt's advice for Hopper), at the
  // first call only; `workspace` is then what the chosen algorithm needs.
  static constexpr size_t kTrialWorkspaceBytes = size_t{32} << 20;

  std::mutex mu;  // one executable may run on several threads
  bool planned = false;
  LtHandle lt;
  DeviceBuffer workspace;
  Fp8GemmPlan plan;
};

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_FP8_GEMM_H_
