// The XLA FFI handlers, registered by Python under kAllGatherMatmulTarget,
// kMatmulReduceScatterTarget, their FP8 twins kFp8AllGatherMatmulTarget and
// kFp8MatmulReduceScatterTarget, and
// kFp8GemmTarget (constants.h) for platform "CUDA". The FP8 GEMM has two
// stages (instantiate, execute) and a state type (fp8_gemm.h).
#ifndef JAX_COMM_GEMM_HANDLERS_H_
#define JAX_COMM_GEMM_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(kAllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kMatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8AllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8MatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8GemmInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kFp8GemmExecute);

namespace jax_comm_gemm {
const XLA_FFI_TypeInfo* Fp8GemmTypeInfo();  // the state's deleter, for its registration
}  // namespace jax_comm_gemm

#endif  // JAX_COMM_GEMM_HANDLERS_H_
