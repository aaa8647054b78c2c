"""Public name of the Flax NNX modules (they live in ``jax_comm_gemm.flax.nnx``)."""

from jax_comm_gemm.flax.nnx import ColumnParallelDense, RowParallelDense, SequenceParallelMLP
from jax_comm_gemm.flax.transformer_nnx import SequenceParallelTransformerBlock

__all__ = ["ColumnParallelDense", "RowParallelDense", "SequenceParallelMLP",
           "SequenceParallelTransformerBlock"]
