"""Public name of the Flax linen modules (they live in ``jax_comm_gemm.flax.linen``)."""

from jax_comm_gemm.flax.linen import (ColumnParallelDense, RowParallelDense,
                                      SequenceParallelMLP)

__all__ = ["ColumnParallelDense", "RowParallelDense", "SequenceParallelMLP"]
