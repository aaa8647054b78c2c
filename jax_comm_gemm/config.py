"""Options shared by the collective matmuls, the dense layers and the Flax modules."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.fp8.recipe import Fp8Recipe
from jax_comm_gemm.runtime.constants import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS
from jax_comm_gemm.runtime.settings import BACKENDS

# How the cuBLASMp backend runs GEMM+ReduceScatter: XLA's dot + psum_scatter, a
# ring of GEMMs and ppermutes in XLA, or a fused algorithm (cuBLASMp's or the
# project's pipelined_ce).
REDUCE_SCATTER_IMPLS = ("xla", "ring") + REDUCE_SCATTER_ALGORITHMS
_FUSED = CublasMpBackend()  # the fused ops' defaults, written once there
# The backends an FP8 config may name: its fused steps run on XLA's collectives,
# the ring, or the extension's fused FP8 ops ("cublasmp": the config's
# algorithms, one scale per tensor); "auto" picks per problem among the three
# (docs/fp8.md).
FP8_BACKENDS = ("auto", "xla", "ring", "cublasmp")


@dataclasses.dataclass(frozen=True)
class CommGemmConfig:
  """How the comm+GEMM ops run. The defaults need no changing: ``auto`` picks
  per problem, on the axes that :func:`jax_comm_gemm.connect` set up.

  Attributes:
    backend: ``"auto"`` (per op and shape, the implementation measured
      fastest, on connected axes; XLA elsewhere), ``"cublasmp"`` (always the
      fused ops; an error where they cannot run), ``"xla"``, ``"ring"``
      (both ops as rings of per-shard GEMMs and ``lax.ppermute`` that XLA
      overlaps; runs everywhere), or a
      :class:`~jax_comm_gemm.backends.Backend` instance. The environment
      variable ``JAX_COMM_GEMM_BACKEND`` overrides it, for A/B runs.
    all_gather_algorithm: the fused AllGather+GEMM where ``auto`` has no
      measurement and for ``"cublasmp"``: cuBLASMp's ``"split_p2p"`` or
      ``"default"``, or the project's own ``"pipelined_ce"`` (a cuBLASLt GEMM
      per shard beside NCCL transfers on its copy engines), which spends a
      fraction of cuBLASMp's host time per call:
      docs/design.md#the-projects-own-algorithms.
    reduce_scatter: how the fused backends run GEMM+ReduceScatter: ``"xla"``
      (dot, then ``lax.psum_scatter``; the default, because inside a training
      step XLA overlaps it with other GEMMs), ``"ring"``, cuBLASMp's
      ``"split_p2p"`` / ``"default"``, or the project's ``"pipelined_ce"``:
      docs/design.md#gemmreducescatter.
    reuse_gathered: ``None`` reuses the operand that a fused AllGather+GEMM
      gathered wherever the self-test's verdict passes; ``False`` always
      gathers again with ``lax.all_gather`` (for A/B runs and debugging).
    fp8: ``None`` (the GEMMs run in the inputs' dtype) or an
      :class:`~jax_comm_gemm.fp8.Fp8Recipe`: the GEMMs run in FP8 (E4M3
      forward, E5M2 gradients, current scaling agreed over the axis), FP8
      bytes are all-gathered, and the row-parallel backward reuses the
      gathered FP8 grad_output (docs/fp8.md). FP8 runs with ``backend``
      "xla" (XLA's collectives), "ring" (per-shard FP8 GEMMs overlapped with
      ppermutes), "cublasmp" (the extension's fused FP8 ops on
      ``all_gather_algorithm`` and ``reduce_scatter``; one scale per tensor)
      or "auto" (per problem, as autotune measured among those three; XLA's
      collectives where nothing was measured).

  >>> CommGemmConfig().backend
  'auto'
  >>> CommGemmConfig(reduce_scatter="fast")
  Traceback (most recent call last):
  ...
  ValueError: CommGemmConfig.reduce_scatter must be one of ('xla', 'ring', 'default', 'split_p2p', 'pipelined_ce'), got 'fast'
  """

  backend: Any = "auto"
  all_gather_algorithm: str = _FUSED.all_gather_algorithm
  reduce_scatter: str = _FUSED.reduce_scatter
  reuse_gathered: bool | None = None
  fp8: Fp8Recipe | None = None

  def __post_init__(self):
    if not (self.backend in BACKENDS if isinstance(self.backend, str)
            else isinstance(self.backend, Backend)):
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

  @property
  def fused(self) -> CublasMpBackend:
    """The fused ops with this config's algorithms.

    >>> CommGemmConfig(all_gather_algorithm="pipelined_ce").fused.all_gather_algorithm
    'pipelined_ce'
    """
    return CublasMpBackend(self.all_gather_algorithm, self.reduce_scatter)


def _check_choice(field: str, value, allowed: tuple[str, ...]) -> None:
  if not isinstance(value, str) or value not in allowed:
    raise ValueError(
        f"CommGemmConfig.{field} must be one of {allowed}, got {value!r}")


DEFAULT_CONFIG = CommGemmConfig()
