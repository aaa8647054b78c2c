"""jax-comm-gemm: cuBLASMp's overlapped AllGather+GEMM and GEMM+ReduceScatter
for sequence-parallel dense layers in JAX, with an XLA fallback.

The folders, from the top (each imports only those below it): ``flax/`` (the
linen and NNX modules), ``layers/`` (the dense layers, local and global, and
the transformer block), ``collective_matmul.py`` (the custom_vjps),
``backends/`` (how one op runs, the one place that routes it, autotuning),
``fp8/``, ``runtime/`` (the extension, ``connect``, the routing plan, the
registry) and ``diagnostics/``. The top-level ``linen``, ``nnx``, ``sharded``,
``dense`` and ``hlo`` modules are public names for what the folders define."""

import re as _re

import jax as _jax

# The oldest jax the tests run on (CI's oldest leg); README "Supported versions".
OLDEST_JAX = "0.10.2"


def require_jax(version: str) -> None:
  """Refuses a jax older than OLDEST_JAX, naming both versions.

  >>> require_jax("0.9.2")
  Traceback (most recent call last):
  ...
  ImportError: jax-comm-gemm needs jax >= 0.10.2 (the oldest version it is tested with); this environment has jax 0.9.2: pip install -U "jax>=0.10.2"
  """
  def release(v):
    return tuple(int(part) for part in _re.findall(r"\d+", v)[:3])
  if release(version) < release(OLDEST_JAX):
    raise ImportError(f"jax-comm-gemm needs jax >= {OLDEST_JAX} (the oldest version it is "
                      f"tested with); this environment has jax {version}: "
                      f'pip install -U "jax>={OLDEST_JAX}"')


require_jax(_jax.__version__)

from jax_comm_gemm import diagnostics, hlo, sharded  # noqa: E402
from jax_comm_gemm.backends import (AutoBackend, Backend, Capability, CublasMpBackend,
                                    TunedStep, XlaBackend, autotune, autotune_step,
                                    problems_of, resolve_backend)
from jax_comm_gemm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.config import ALGORITHMS, CommGemmConfig
from jax_comm_gemm.layers.dense import column_parallel_dense, mlp, row_parallel_dense
from jax_comm_gemm.runtime import REGISTRY, connect


def cublasmp_version() -> int:
  """The loaded cuBLASMp's version (major*10000 + minor*100 + patch); 0 where
  cuBLASMp cannot run (no GPU, no extension, no library). Never raises.

  >>> cublasmp_version()  # on a machine without a GPU
  0
  """
  return REGISTRY.cublasmp_version()


def cublasmp_status() -> Capability:
  """Whether the cuBLASMp backend can run here, and if not, why.

  >>> status = cublasmp_status()
  >>> status.ok, "GPU" in status.reason  # on a machine without a GPU
  (False, True)
  """
  return REGISTRY.cublasmp_status()


__all__ = [
    "ALGORITHMS", "AutoBackend", "Backend", "Capability", "CommGemmConfig", "CublasMpBackend",
    "REGISTRY", "TunedStep", "XlaBackend", "all_gather_matmul", "autotune", "autotune_step",
    "column_parallel_dense", "connect",
    "cublasmp_status", "cublasmp_version", "diagnostics", "hlo", "matmul_reduce_scatter",
    "mlp", "problems_of", "resolve_backend", "row_parallel_dense", "sharded",
]
__version__ = "0.1.0"
