"""The values that Python and the C++ extension must agree on, defined once here.

The extension's own definitions (``xla_ffi/``) are exported by the small module
``jax_comm_gemm._constants``, which loads without a GPU;
``tests/test_constants.py`` fails if the two sides differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# XLA FFI target names of the handlers.
TARGETS: Mapping[str, str] = MappingProxyType({
    "all_gather_matmul": "jax_comm_gemm_all_gather_matmul",
    "matmul_reduce_scatter": "jax_comm_gemm_matmul_reduce_scatter",
    # their FP8 twins: FP8 x and w with their scales (xla_ffi/context.h)
    "fp8_all_gather_matmul": "jax_comm_gemm_fp8_all_gather_matmul",
    "fp8_matmul_reduce_scatter": "jax_comm_gemm_fp8_matmul_reduce_scatter",
    # the FP8 GEMM with scale pointers and a timed algorithm (xla_ffi/fp8_gemm.cc)
    "fp8_gemm": "jax_comm_gemm_fp8_gemm",
})

# The fused ops' algorithms, by name: two of cuBLASMp's (their
# cublasMpMatmulAlgoType_t values), and the project's own pipelined comm-GEMM
# (xla_ffi/pipelined.h), numbered clear of cuBLASMp's enum. cuBLASMp's others
# are not offered (docs/design.md#options-removed-and-why).
ALGORITHMS: Mapping[str, int] = MappingProxyType({
    "default": 0,
    "split_p2p": 1,
    "pipelined_ce": 101,
})
# The project's own algorithms (xla_ffi/pipelined.h).
OWN_ALGORITHMS = frozenset({"pipelined_ce"})
# The algorithms a fused GEMM+ReduceScatter takes: every one.
REDUCE_SCATTER_ALGORITHMS: tuple[str, ...] = tuple(ALGORITHMS)

# Where cuBLASMp leaves the gathered operand in its workspace (capability.py).
GATHERED_LAYOUTS: Mapping[str, int] = MappingProxyType({"front": 0, "tail": 1})
