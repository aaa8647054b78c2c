"""Public name of the layers on local shards (they live in
``jax_comm_gemm.layers.local``)."""

from jax_comm_gemm.layers.histories import init_mlp_fp8_histories
from jax_comm_gemm.layers.local import column_parallel_dense, mlp, row_parallel_dense

__all__ = ["column_parallel_dense", "init_mlp_fp8_histories", "mlp", "row_parallel_dense"]
