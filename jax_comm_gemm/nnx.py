"""Public name of the Flax NNX modules (they live in ``jax_comm_gemm.flax.nnx``) and of
their FP8 "delayed" scaling state (``jax_comm_gemm.flax.nnx_fp8``)."""

from jax_comm_gemm.flax.nnx import ColumnParallelDense, RowParallelDense, SequenceParallelMLP
from jax_comm_gemm.flax.nnx_fp8 import OverwriteWithGradient, overwrite_with_gradient
from jax_comm_gemm.flax.llama_nnx import SequenceParallelLlamaBlock
from jax_comm_gemm.flax.transformer_nnx import SequenceParallelTransformerBlock

__all__ = ["ColumnParallelDense", "OverwriteWithGradient", "RowParallelDense",
           "SequenceParallelLlamaBlock", "SequenceParallelMLP", "SequenceParallelTransformerBlock",
           "overwrite_with_gradient"]
