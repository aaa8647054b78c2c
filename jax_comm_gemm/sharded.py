"""Public name of the layers on global arrays (they live in
``jax_comm_gemm.layers.sharded``)."""

from jax_comm_gemm.layers.histories import init_mlp_fp8_histories
from jax_comm_gemm.layers.sharded import (column_parallel_dense, mlp, resolve_mesh,
                                          row_parallel_dense)

__all__ = ["column_parallel_dense", "init_mlp_fp8_histories", "mlp", "resolve_mesh",
           "row_parallel_dense"]
