"""FP8 (E4M3 forward, E5M2 gradients) collective matmuls on XLA's collectives,
the ring, or the extension's fused FP8 ops (handed in as a backend): a layer
below ``collective_matmul`` and the dense layers. ``recipe``: :class:`Fp8Recipe`;
``quantize``: amax, scale, saturating cast; ``gemm``: the FP8 GEMM in the TN
form and the weight's FP8 copies; ``steps``: what the two ops share, and where
each fused step runs; ``matmul``: the differentiable ops; ``mlp``: the MLP's two
as one (docs/fp8.md)."""

from jax_comm_gemm.fp8.gemm import cublaslt_gemm_tn, fp8_gemm_tn, weight_copies
from jax_comm_gemm.fp8.matmul import (FUSED_SCOPE, STANDALONE_SCOPE, fp8_all_gather_matmul,
                                      fp8_matmul_reduce_scatter, xla_gather)
from jax_comm_gemm.fp8.mlp import fp8_mlp
from jax_comm_gemm.fp8.quantize import (agree, amax, dequantize, fp8_max, inverse,
                                        quantize_columns_transposed, quantize_rows,
                                        quantize_tensor, saturating_cast, scale_from_amax)
from jax_comm_gemm.fp8.recipe import AmaxHistory, Fp8Recipe

__all__ = [
    "AmaxHistory", "FUSED_SCOPE", "Fp8Recipe", "STANDALONE_SCOPE", "agree", "amax", "cublaslt_gemm_tn",
    "dequantize",
    "fp8_all_gather_matmul", "fp8_gemm_tn", "fp8_matmul_reduce_scatter", "fp8_max", "fp8_mlp",
    "inverse", "quantize_columns_transposed", "quantize_rows", "quantize_tensor",
    "saturating_cast", "scale_from_amax", "weight_copies", "xla_gather",
]
