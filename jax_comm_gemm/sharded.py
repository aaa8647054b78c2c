"""Public name of the layers on global arrays (``jax_comm_gemm.layers.dense``)."""

from jax_comm_gemm.layers.dense import init_mlp_fp8_histories, resolve_mesh
from jax_comm_gemm.layers.dense import sharded_column_parallel_dense as column_parallel_dense
from jax_comm_gemm.layers.dense import sharded_mlp as mlp
from jax_comm_gemm.layers.dense import sharded_row_parallel_dense as row_parallel_dense

__all__ = ["column_parallel_dense", "init_mlp_fp8_histories", "mlp", "resolve_mesh",
           "row_parallel_dense"]
