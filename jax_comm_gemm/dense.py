"""Public name of the layers on local shards (``jax_comm_gemm.layers.dense``)."""

from jax_comm_gemm.layers.dense import (column_parallel_dense, init_mlp_fp8_histories, mlp,
                                        row_parallel_dense)

__all__ = ["column_parallel_dense", "init_mlp_fp8_histories", "mlp", "row_parallel_dense"]
