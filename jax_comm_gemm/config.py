"""Options shared by the collective matmuls, the dense layers and the Flax modules."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.runtime.constants import ALGORITHMS, GATHERED_LAYOUTS, MULTICAST_ALGORITHMS
from jax_comm_gemm.runtime.settings import BACKENDS

# How the cuBLASMp backend runs GEMM+ReduceScatter: XLA's dot + psum_scatter, a
# ring of GEMMs and ppermutes in XLA, or a fused algorithm (cuBLASMp's or ours).
REDUCE_SCATTER_IMPLS = ("xla", "ring") + tuple(ALGORITHMS)


@dataclasses.dataclass(frozen=True)
class CommGemmConfig:
  """How the comm+GEMM ops run.

  Attributes:
    backend: ``"auto"`` (cuBLASMp on GPUs where it loads and the mesh axis is
      connected by :func:`jax_comm_gemm.connect`, XLA elsewhere),
      ``"cublasmp"`` (an error where it cannot run), ``"xla"``, ``"ring"``
      (both ops as rings of per-shard GEMMs and ``lax.ppermute`` that XLA
      overlaps; runs everywhere, and ``auto`` may choose it), or a
      :class:`~jax_comm_gemm.backends.Backend` instance. The environment
      variable ``JAX_COMM_GEMM_BACKEND=xla`` overrides it, for A/B runs.
    all_gather_algorithm: algorithm of the fused AllGather+GEMM: one of
      cuBLASMp's, or the project's own ``"pipelined"`` / ``"pipelined_ce"``
      (a cuBLASLt GEMM per shard beside NCCL transfers, by NCCL's kernels or
      its copy engines; xla_ffi/pipelined.h), which enqueue a few CUDA and
      NCCL calls where cuBLASMp's call spends 118-277 us of host time at
      4096^3 (GPU run 20, benchmarks/results/2026-11-30_h200x2/README.md).
    reduce_scatter: how the cuBLASMp backend runs GEMM+ReduceScatter:
      ``"xla"`` (dot, then ``lax.psum_scatter``), ``"ring"`` (chunked GEMMs
      and ``lax.ppermute`` that XLA overlaps), a cuBLASMp algorithm, or the
      project's own ``"pipelined"`` / ``"pipelined_ce"`` (a cuBLASLt GEMM per
      block of rows, each block's partial sums moved beside the next GEMM by
      an ``ncclReduce``, or by an ``ncclAlltoAll`` on copy engines and added
      by the owner's GEMM). The
      default is ``"xla"``: on 2x H200, cuBLASMp's ``"default"`` and the ring
      beat XLA by up to 8% and 11% alone at large shapes, but neither is
      faster inside the MLP step, where XLA overlaps its reduce-scatter with
      other GEMMs (GPU runs 20-21, benchmarks/results/2026-11-30_h200x2/README.md).
    reuse_gathered: ``None`` reuses the operand that a fused AllGather+GEMM
      gathered wherever the cached capability check passes; ``False`` always
      gathers again with ``lax.all_gather`` (for A/B runs and debugging).
    fuse_weight_gradient: in the row-parallel backward, let the AllGather+GEMM
      that computes the input gradient also compute the weight gradient,
      reading its gathered grad_output where it gathered it (cuBLASMp's
      workspace, ``pipelined_ce``'s window: xla_ffi/weight_gradient.h), instead
      of copying it out for XLA's GEMM. Where the backend cannot (XLA, the
      ring, ``pipelined``, a failed verdict) the copy path runs anyway. Off by
      default: on 2x H200 (GPU run 37) the fused call made the row-parallel
      layer 1.4% faster alone but the MLP step no faster (within 0.5%), and
      the step's compiled temp memory grew by up to 320 MiB (1024 against
      704 MiB at 8192 x 8192 x 28672, over pure JAX's 832).
    allow_multicast: permit the NVLink-multicast algorithms.
    gathered_layout: where cuBLASMp leaves the gathered operand, ``None`` to
      choose from the cuBLASMp version (a debugging knob: a wrong layout is
      caught by the self-test and turns reuse off).
  """

  backend: Any = "auto"
  all_gather_algorithm: str = "split_p2p"
  reduce_scatter: str = "xla"
  reuse_gathered: bool | None = None
  fuse_weight_gradient: bool = False
  allow_multicast: bool = False
  gathered_layout: str | None = None

  def __post_init__(self):
    if not (self.backend in BACKENDS if isinstance(self.backend, str)
            else isinstance(self.backend, Backend)):
      raise ValueError(
          f"CommGemmConfig.backend must be one of {BACKENDS} or a Backend "
          f"instance, got {self.backend!r}")
    _check_algorithm("all_gather_algorithm", self.all_gather_algorithm,
                     tuple(ALGORITHMS), self.allow_multicast)
    _check_algorithm("reduce_scatter", self.reduce_scatter,
                     REDUCE_SCATTER_IMPLS, self.allow_multicast)
    if self.reuse_gathered not in (None, False):
      raise ValueError(
          "CommGemmConfig.reuse_gathered must be None (reuse where the "
          f"capability check passes) or False, got {self.reuse_gathered!r}")
    if not isinstance(self.fuse_weight_gradient, bool):
      raise ValueError(
          "CommGemmConfig.fuse_weight_gradient must be True or False, got "
          f"{self.fuse_weight_gradient!r}")
    if self.gathered_layout is not None and self.gathered_layout not in GATHERED_LAYOUTS:
      raise ValueError(
          f"CommGemmConfig.gathered_layout must be None or one of "
          f"{tuple(GATHERED_LAYOUTS)}, got {self.gathered_layout!r}")


def _check_algorithm(field: str, value: str, allowed: tuple[str, ...],
                     allow_multicast: bool) -> None:
  if value not in allowed:
    raise ValueError(
        f"CommGemmConfig.{field} must be one of {allowed}, got {value!r}")
  if value in MULTICAST_ALGORITHMS and not allow_multicast:
    raise ValueError(
        f"CommGemmConfig.{field}={value!r} uses NVLink multicast, which can "
        "take a shared host's GPUs out of service; pass allow_multicast=True "
        "to use it anyway")


DEFAULT_CONFIG = CommGemmConfig()
