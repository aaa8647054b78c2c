"""jax-comm-gemm: cuBLASMp's overlapped AllGather+GEMM and GEMM+ReduceScatter
for sequence-parallel dense layers in JAX, with an XLA fallback.

The top level holds what a user of a tensor-parallel layer needs
(``__all__``): ``CommGemmConfig``, ``connect``, the functional ops
(``all_gather_matmul``, ``matmul_reduce_scatter``), the dense layers on local
shards (``column_parallel_dense``, ``row_parallel_dense``, ``mlp``),
``autotune_step``, ``cublasmp_status`` and ``cublasmp_version``, and the public
submodules: ``linen`` and ``nnx`` (the Flax modules), ``sharded`` (the layers on
global arrays), ``dense``, ``hlo``, ``diagnostics``, ``fp8``, ``backends`` (the
implementations, ``autotune``, ``problems_of``, ``TunedStep``) and ``runtime``
(``REGISTRY``, ``Capability``). A name that the top level exported before and
that moved to a submodule (:data:`MOVED`) still resolves, with a
``DeprecationWarning`` naming its new import, until the next release.

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

import importlib as _importlib  # noqa: E402
import warnings as _warnings  # noqa: E402

from jax_comm_gemm import backends, diagnostics, fp8, hlo, runtime, sharded  # noqa: E402
from jax_comm_gemm.backends import autotune_step  # noqa: E402
from jax_comm_gemm.collective_matmul import all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from jax_comm_gemm.config import CommGemmConfig  # noqa: E402
from jax_comm_gemm.layers.dense import column_parallel_dense, mlp, row_parallel_dense  # noqa: E402
from jax_comm_gemm.runtime import connect  # noqa: E402


def cublasmp_version() -> int:
  """The loaded cuBLASMp's version (major*10000 + minor*100 + patch); 0 where
  cuBLASMp cannot run (no GPU, no extension, no library). Never raises.

  >>> cublasmp_version()  # on a machine without a GPU
  0
  """
  return runtime.REGISTRY.cublasmp_version()


def cublasmp_status() -> runtime.Capability:
  """Whether the cuBLASMp backend can run here, and if not, why.

  >>> status = cublasmp_status()
  >>> status.ok, "GPU" in status.reason  # on a machine without a GPU
  (False, True)
  """
  return runtime.REGISTRY.cublasmp_status()


# Names the top level exported before the surface was curated, and the module
# each now lives in. They resolve, with a DeprecationWarning, for one release.
MOVED = {
    "ALGORITHMS": "jax_comm_gemm.config",
    "AutoBackend": "jax_comm_gemm.backends",
    "Backend": "jax_comm_gemm.backends",
    "Capability": "jax_comm_gemm.runtime",
    "CublasMpBackend": "jax_comm_gemm.backends",
    "REGISTRY": "jax_comm_gemm.runtime",
    "TunedStep": "jax_comm_gemm.backends",
    "XlaBackend": "jax_comm_gemm.backends",
    "autotune": "jax_comm_gemm.backends",
    "problems_of": "jax_comm_gemm.backends",
    "resolve_backend": "jax_comm_gemm.backends",
}

# Submodules imported on first use (they import flax), so that ``jcg.nnx`` works
# after a plain ``import jax_comm_gemm as jcg``.
_LAZY_SUBMODULES = ("dense", "linen", "nnx")


def __getattr__(name: str):
  """A lazily imported submodule, or a moved name with a DeprecationWarning
  that names its new home.

  >>> import jax_comm_gemm as jcg, warnings
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   registry = jcg.REGISTRY
  >>> print(caught[0].message)
  jax_comm_gemm.REGISTRY moved: import it from jax_comm_gemm.runtime (from jax_comm_gemm.runtime import REGISTRY); the old name goes in the next release
  >>> registry is jcg.runtime.REGISTRY
  True
  """
  if name in _LAZY_SUBMODULES:
    return _importlib.import_module(f"{__name__}.{name}")
  home = MOVED.get(name)
  if home is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  _warnings.warn(f"{__name__}.{name} moved: import it from {home} (from {home} import "
                 f"{name}); the old name goes in the next release", DeprecationWarning,
                 stacklevel=2)
  return getattr(_importlib.import_module(home), name)


def __dir__() -> list[str]:
  """The module's own names and its public submodules; not the moved names."""
  return sorted(set(globals()) | set(__all__))


__all__ = [
    "CommGemmConfig", "all_gather_matmul", "autotune_step", "backends",
    "column_parallel_dense", "connect", "cublasmp_status", "cublasmp_version", "dense",
    "diagnostics", "fp8", "hlo", "linen", "matmul_reduce_scatter", "mlp", "nnx",
    "row_parallel_dense", "runtime", "sharded",
]
__version__ = "0.1.0"
