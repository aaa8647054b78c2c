// The XLA FFI handlers, registered by Python under kAllGatherMatmulTarget,
// kAllGatherMatmulWeightGradientTarget and kMatmulReduceScatterTarget
// (constants.h) for platform "CUDA".
#ifndef JAX_COMM_GEMM_HANDLERS_H_
#define JAX_COMM_GEMM_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(kAllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kAllGatherMatmulWeightGradient);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMatmulReduceScatter);

#endif  // JAX_COMM_GEMM_HANDLERS_H_
