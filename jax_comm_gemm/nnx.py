"""Public name of the Flax NNX modules (they live in ``jax_comm_gemm.flax.nnx``)."""

from jax_comm_gemm.flax.nnx import ColumnParallelDense, RowParallelDense, SequenceParallelMLP

__all__ = ["ColumnParallelDense", "RowParallelDense", "SequenceParallelMLP"]
