// Where the gathered operand of an AllGather+GEMM sits in cuBLASMp's device
// workspace, for each GatheredLayout. Pure arithmetic, unit-tested on the CPU;
// Context copies the region out at the offset this returns.
#ifndef JAX_COMM_GEMM_LAYOUT_H_
#define JAX_COMM_GEMM_LAYOUT_H_

#include <cstddef>

#include "constants.h"
#include "status.h"

namespace jax_comm_gemm {

// cuBLASMp 0.10 ends the gathered operand this many bytes before the end of
// the workspace it was given (measured: docs/design.md#the-gathered-operand-and-its-layout).
inline constexpr size_t kTailPadding = 16;

// The byte offset of a `gathered_bytes` gathered operand in a cuBLASMp
// workspace of `workspace_bytes` (the size the call asked for, not the size of
// the possibly larger buffer), or FailedPrecondition if it cannot fit there.
Status GatheredOffset(GatheredLayout layout, size_t gathered_bytes, size_t workspace_bytes,
                      size_t* offset);

}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_LAYOUT_H_
