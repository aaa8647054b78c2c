"""jax-comm-gemm: cuBLASMp's overlapped AllGather+GEMM and GEMM+ReduceScatter
for sequence-parallel dense layers in JAX, with an XLA fallback.

Layers of the API, from the top:

* ``jax_comm_gemm.linen`` / ``jax_comm_gemm.nnx``: Flax modules.
* ``jax_comm_gemm.sharded``: the layers on global arrays (wrap ``shard_map``).
* ``jax_comm_gemm.dense``: the layers on local shards, inside ``shard_map``.
* ``all_gather_matmul`` / ``matmul_reduce_scatter``: the differentiable
  collective matmuls that everything above is built on.
"""

from jax_comm_gemm import hlo, sharded
from jax_comm_gemm.backends import (Backend, Capability, CublasMpBackend, XlaBackend,
                                    resolve_backend)
from jax_comm_gemm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.config import ALGORITHMS, CommGemmConfig
from jax_comm_gemm.dense import column_parallel_dense, mlp, row_parallel_dense
from jax_comm_gemm.registry import REGISTRY


def cublasmp_version() -> int:
  """The loaded cuBLASMp's version (major*10000 + minor*100 + patch); 0 where
  cuBLASMp cannot run (no GPU, no extension, no library). Never raises."""
  return REGISTRY.cublasmp_version()


def cublasmp_status() -> Capability:
  """Whether the cuBLASMp backend can run here, and if not, why."""
  return REGISTRY.cublasmp_status()


__all__ = [
    "ALGORITHMS", "Backend", "Capability", "CommGemmConfig", "CublasMpBackend",
    "XlaBackend", "all_gather_matmul", "column_parallel_dense", "cublasmp_status",
    "cublasmp_version", "matmul_reduce_scatter", "mlp", "resolve_backend",
    "hlo", "row_parallel_dense", "sharded",
]
__version__ = "0.1.0"
