"""Public name of the Flax linen modules (they live in ``jax_comm_gemm.flax.linen``)."""

from jax_comm_gemm.flax.linen import (ColumnParallelDense, RowParallelDense,
                                      SequenceParallelMLP)
from jax_comm_gemm.flax.llama_linen import SequenceParallelLlamaBlock
from jax_comm_gemm.flax.transformer_linen import SequenceParallelTransformerBlock

__all__ = ["ColumnParallelDense", "RowParallelDense", "SequenceParallelLlamaBlock",
           "SequenceParallelMLP", "SequenceParallelTransformerBlock"]
