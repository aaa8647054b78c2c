"""FP8 (E4M3 forward, E5M2 gradients) collective matmuls on XLA's collectives,
the ring, or the extension's fused FP8 ops (handed in as a backend).

A self-contained layer below ``collective_matmul`` and the dense layers: it
imports only jax, numpy, ``jax_comm_gemm.vma``, ``jax_comm_gemm.validation`` and ``jax_comm_gemm.runtime``
(for the FP8 GEMM custom call's registration).

* ``recipe``: :class:`Fp8Recipe`, what to quantize with.
* ``quantize``: amax, scale, saturating cast; per tensor, row, column.
* ``gemm``: the FP8 GEMM in the TN form XLA runs as one cuBLASLt FP8 call, or
  as the project's custom call (:func:`cublaslt_gemm_tn`), and the weight's
  two FP8 copies.
* ``ring``: the fused steps as rings of per-shard FP8 GEMMs and ppermutes.
* ``steps``: what the two ops share, and where each fused step runs.
* ``matmul``: :func:`fp8_all_gather_matmul` and :func:`fp8_matmul_reduce_scatter`,
  the differentiable ops, FP8 bytes on the wire. docs/fp8.md has the picture.
"""

from jax_comm_gemm.fp8.gemm import cublaslt_gemm_tn, fp8_gemm_tn, weight_copies
from jax_comm_gemm.fp8.matmul import (FUSED_SCOPE, STANDALONE_SCOPE, fp8_all_gather_matmul,
                                      fp8_matmul_reduce_scatter, xla_gather)
from jax_comm_gemm.fp8.quantize import (agree, amax, dequantize, fp8_max, inverse,
                                        quantize_columns_transposed, quantize_rows,
                                        quantize_tensor, saturating_cast, scale_from_amax)
from jax_comm_gemm.fp8.recipe import AmaxHistory, Fp8Recipe

__all__ = [
    "AmaxHistory", "FUSED_SCOPE", "Fp8Recipe", "STANDALONE_SCOPE", "agree", "amax", "cublaslt_gemm_tn",
    "dequantize",
    "fp8_all_gather_matmul", "fp8_gemm_tn", "fp8_matmul_reduce_scatter", "fp8_max",
    "inverse", "quantize_columns_transposed", "quantize_rows", "quantize_tensor",
    "saturating_cast", "scale_from_amax", "weight_copies", "xla_gather",
]
