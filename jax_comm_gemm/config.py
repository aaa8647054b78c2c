"""Options shared by the collective matmuls, the dense layers and the Flax
modules, with their defaults (the fused ops' too: ``CublasMpBackend`` takes
them from here), and the check that a value is such a config. Below the
backends: it imports none of them."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jax_comm_gemm.fp8.recipe import Fp8Recipe
from jax_comm_gemm.runtime.constants import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
from jax_comm_gemm.runtime.settings import BACKENDS

# How the fused backends run GEMM+ReduceScatter.
REDUCE_SCATTER_IMPLS = ("xla", "ring") + REDUCE_SCATTER_ALGORITHMS
# The fused ops' defaults (docs/design.md#gemmreducescatter).
DEFAULT_ALL_GATHER_ALGORITHM = "split_p2p"
DEFAULT_REDUCE_SCATTER = "xla"
# The backends an FP8 config may name (docs/fp8.md).
FP8_BACKENDS = ("auto", "xla", "ring", "cublasmp")


@runtime_checkable
class BackendLike(Protocol):
  """What ``CommGemmConfig.backend`` takes besides a name: an object with the
  methods of :class:`jax_comm_gemm.backends.Backend` (the interface lives with
  the backends, above this module)."""

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None): ...

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None): ...

  def gathered_reuse(self, axis_size, dtype, transpose_w): ...


@dataclasses.dataclass(frozen=True)
class CommGemmConfig:
  """How the comm+GEMM ops run. The defaults need no changing: ``auto`` picks
  per problem, on the axes that :func:`jax_comm_gemm.connect` set up.

  Attributes:
    backend: ``"auto"`` (per op and shape, the implementation measured
      fastest, on connected axes; XLA elsewhere), ``"cublasmp"`` (always the
      fused ops; an error where they cannot run), ``"xla"``, ``"ring"`` (rings
      of per-shard GEMMs and ``lax.ppermute``; runs everywhere), or a
      :class:`~jax_comm_gemm.backends.Backend`. ``JAX_COMM_GEMM_BACKEND``
      overrides it, for A/B runs.
    all_gather_algorithm: the fused AllGather+GEMM where ``auto`` has no
      measurement and for ``"cublasmp"``: cuBLASMp's ``"split_p2p"`` or
      ``"default"``, or the project's ``"pipelined_ce"``
      (docs/design.md#the-projects-own-algorithms).
    reduce_scatter: how the fused backends run GEMM+ReduceScatter: ``"xla"``
      (the default), ``"ring"``, or one of the algorithms above
      (docs/design.md#gemmreducescatter).
    reuse_gathered: ``None`` reuses the operand a fused AllGather+GEMM gathered
      wherever the self-test passed; ``False`` always gathers again.
    fp8: ``None``, or an :class:`~jax_comm_gemm.fp8.Fp8Recipe`: the GEMMs run
      in FP8 with FP8 bytes on the wire, on ``backend`` "xla", "ring",
      "cublasmp" (the fused FP8 ops, one scale per tensor) or "auto"
      (docs/fp8.md).

  >>> CommGemmConfig().backend
  'auto'
  >>> CommGemmConfig(reduce_scatter="fast")
  Traceback (most recent call last):
  ...
  ValueError: CommGemmConfig.reduce_scatter must be one of ('xla', 'ring', 'default', 'split_p2p', 'pipelined_ce'), got 'fast'
  """

  backend: Any = "auto"
  all_gather_algorithm: str = DEFAULT_ALL_GATHER_ALGORITHM
  reduce_scatter: str = DEFAULT_REDUCE_SCATTER
  reuse_gathered: bool | None = None
  fp8: Fp8Recipe | None = None

  def __post_init__(self):
    if not (self.backend in BACKENDS if isinstance(self.backend, str)
            else isinstance(self.backend, BackendLike)):
      raise ValueError(
          f"CommGemmConfig.backend must be one of {BACKENDS} or a Backend "
          f"instance, got {self.backend!r}")
    _check_choice("all_gather_algorithm", self.all_gather_algorithm, tuple(ALGORITHMS))
    _check_choice("reduce_scatter", self.reduce_scatter, REDUCE_SCATTER_IMPLS)
    if self.reuse_gathered is not None:
      if not isinstance(self.reuse_gathered, (bool, np.bool_)) or self.reuse_gathered:
        raise ValueError(
            "CommGemmConfig.reuse_gathered must be None (reuse where the "
            f"self-test passed) or False, got {self.reuse_gathered!r}")
      object.__setattr__(self, "reuse_gathered", False)
    if self.fp8 is not None:
      if not isinstance(self.fp8, Fp8Recipe):
        raise ValueError("CommGemmConfig.fp8 must be None or a jax_comm_gemm.fp8.Fp8Recipe, "
                         f"got {self.fp8!r}")
      if self.backend not in FP8_BACKENDS:
        raise ValueError(f"CommGemmConfig.fp8: FP8 runs on XLA's collectives, the ring or "
                         f"the fused ops; backend must be one of {FP8_BACKENDS}, got "
                         f"{self.backend!r}")
      if self.backend == "cublasmp" and not self.fp8.per_tensor:
        raise ValueError(f"CommGemmConfig.fp8: backend 'cublasmp' runs FP8 with one scale "
                         f"per tensor ('tensor' or 'delayed' scaling); {self.fp8.scaling!r} "
                         f"scaling runs on backend 'xla', 'ring' or 'auto'")


def _check_choice(field: str, value, allowed: tuple[str, ...]) -> None:
  if not isinstance(value, str) or value not in allowed:
    raise ValueError(
        f"CommGemmConfig.{field} must be one of {allowed}, got {value!r}")


DEFAULT_CONFIG = CommGemmConfig()


def check_config(where: str, config) -> None:
  """Raises TypeError naming `config` unless it is a CommGemmConfig.

  >>> check_config("f", CommGemmConfig())
  >>> check_config("f", "xla")
  Traceback (most recent call last):
  ...
  TypeError: f: `config` must be a jax_comm_gemm.CommGemmConfig, got 'xla' (str); e.g. config=CommGemmConfig(backend='xla')
  """
  if not isinstance(config, CommGemmConfig):
    hint = (f"config=CommGemmConfig(backend={config!r})"
            if isinstance(config, str) else "config=CommGemmConfig()")
    raise TypeError(
        f"{where}: `config` must be a jax_comm_gemm.CommGemmConfig, got "
        f"{config!r} ({type(config).__name__}); e.g. {hint}")
