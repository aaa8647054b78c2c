"""The values that Python and the C++ extension must agree on, defined once here.

The extension's own definitions (``xla_ffi/``) are exported by the small module
``jax_comm_gemm._constants``, which loads without a GPU;
``tests/test_constants.py`` fails if the two sides differ.
"""

from __future__ import annotations

# XLA FFI target names of the two handlers.
TARGETS: dict[str, str] = {
    "all_gather_matmul": "jax_comm_gemm_all_gather_matmul",
    "matmul_reduce_scatter": "jax_comm_gemm_matmul_reduce_scatter",
    # the AllGather+GEMM that also computes the weight gradient in place
    "all_gather_matmul_weight_gradient": "jax_comm_gemm_all_gather_matmul_weight_gradient",
}

# The fused ops' algorithms, by name: cuBLASMp's cublasMpMatmulAlgoType_t, and
# the project's own pipelined comm-GEMMs (xla_ffi/pipelined.h).
ALGORITHMS: dict[str, int] = {
    "default": 0,
    "split_p2p": 1,
    "split_multicast": 2,
    "atomic_p2p": 3,
    "atomic_multicast": 4,
    "no_overlap": 5,
    "pipelined": 100,
    "pipelined_ce": 101,
}
# The project's own algorithms (xla_ffi/pipelined.h), for both ops.
OWN_ALGORITHMS = frozenset({"pipelined", "pipelined_ce"})

# NVLink multicast can take a shared host's GPUs out of service: never without
# an explicit opt-in, and never in the self-test.
MULTICAST_ALGORITHMS = frozenset({"split_multicast", "atomic_multicast"})

# Where cuBLASMp leaves the gathered operand in its workspace (capability.py).
GATHERED_LAYOUTS: dict[str, int] = {"front": 0, "tail": 1}

# How each cuBLASMp call is ordered against XLA's work (xla_ffi/constants.h),
# the default first. The unsafe ones need an opt-in, each for its reason.
FENCES: tuple[str, ...] = ("isolated", "own_stream", "barrier", "host", "none")
UNSAFE_FENCES: dict[str, str] = {
    "none": "gives wrong results: nothing keeps a peer's next call off this rank's workspace",
    "own_stream": "orders nothing across ranks: with one process per GPU it gave wrong "
                  "results (README, \"Ordering against XLA\")",
    "host": "orders nothing across ranks: a peer's next call may start while this rank "
            "still reads its workspace (README, \"Ordering against XLA\")",
}
