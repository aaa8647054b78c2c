"""Backends: how one AllGather+GEMM or GEMM+ReduceScatter runs inside shard_map.

Two are built in: :class:`XlaBackend` (``lax.all_gather`` + dot, dot +
``lax.psum_scatter``; runs everywhere) and :class:`CublasMpBackend` (the fused,
overlapped cuBLASMp kernels behind XLA FFI custom calls). :func:`resolve_backend`
picks one at trace time from a :class:`~jax_comm_gemm.config.CommGemmConfig`.

Backends are frozen dataclasses: they are static arguments of the custom_vjp
rules in ``collective_matmul.py``, so they must hash and compare by value.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from jax import lax

from jax_comm_gemm.config import ALGORITHMS, BACKENDS, CommGemmConfig

ENV_BACKEND = "JAX_COMM_GEMM_BACKEND"


@dataclasses.dataclass(frozen=True)
class Capability:
  """Whether a backend can hand out the operand its AllGather+GEMM gathered."""
  ok: bool
  reason: str


def local_matmul(x, w, transpose_w: bool):
  """x @ w, or x @ w.T when `transpose_w`, in the input dtype."""
  contract = 1 if transpose_w else 0
  return lax.dot_general(x, w, (((1,), (contract,)), ((), ())))


def gathered_matmul_t(g, dy):
  """g.T @ dy: the weight gradient from a gathered operand."""
  return lax.dot_general(g, dy, (((0,), (0,)), ((), ())))


def all_gather_tokens(x, axis_name: str):
  return lax.all_gather(x, axis_name, axis=0, tiled=True)


def ring_matmul_reduce_scatter(x, w, axis_name: str, transpose_w: bool):
  """RS(x @ w) as P chunked GEMMs whose partial sums travel a ring by ppermute,
  so that XLA overlaps each transfer with the next GEMM (the collective-matmul
  pattern of JAX's shard_map documentation)."""
  size = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  rows = x.shape[0] // size

  def partial_sum(chunk):
    return local_matmul(lax.dynamic_slice_in_dim(x, chunk * rows, rows, 0), w, transpose_w)

  # Step s adds this shard's part of chunk (rank + 1 + s) % P to the sum that
  # arrives from rank + 1; after P - 1 steps each rank holds its own chunk.
  acc = partial_sum((rank + 1) % size)
  to_previous = [(i, (i - 1) % size) for i in range(size)]
  for step in range(1, size):
    acc = lax.ppermute(acc, axis_name, to_previous) + partial_sum((rank + 1 + step) % size)
  return acc


class Backend:
  """Interface of a backend. All arrays are per-shard, inside shard_map.

  all_gather_matmul: x [n/P, k], w [k, m] (or [m, k] with transpose_w)
    -> y [n, m] (and the gathered x [n, k] with return_gathered).
  matmul_reduce_scatter: x [n, k], w [k, m] (or [m, k]) -> y [n/P, m],
    summed over the axis.
  gathered_reuse: whether return_gathered costs no extra all-gather.
  """

  name = "abstract"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered):
    raise NotImplementedError

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w):
    raise NotImplementedError

  def gathered_reuse(self, axis_size: int, dtype) -> Capability:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaBackend(Backend):
  """XLA's own collectives and dot: the fallback, and the reference for speed."""

  name = "xla"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered):
    g = all_gather_tokens(x, axis_name)
    y = local_matmul(g, w, transpose_w)
    return (y, g) if return_gathered else y

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w):
    return lax.psum_scatter(local_matmul(x, w, transpose_w), axis_name,
                            scatter_dimension=0, tiled=True)

  def gathered_reuse(self, axis_size, dtype):
    return Capability(True, "XLA's all_gather result is an ordinary array")


@dataclasses.dataclass(frozen=True)
class CublasMpBackend(Backend):
  """cuBLASMp's fused AllGather+GEMM and GEMM+ReduceScatter, via XLA FFI."""

  all_gather_algorithm: str = "split_p2p"
  reduce_scatter: str = "xla"
  gathered_layout: str | None = None

  name = "cublasmp"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered):
    from jax_comm_gemm import ffi_ops  # noqa: PLC0415  (imports the extension)

    if lax.axis_size(axis_name) == 1:  # nothing to communicate
      return XlaBackend().all_gather_matmul(
          x, w, axis_name, transpose_w=transpose_w, return_gathered=return_gathered)
    expose = return_gathered and self.gathered_reuse(
        lax.axis_size(axis_name), x.dtype).ok
    outs = ffi_ops.all_gather_matmul(
        x, w, axis_name, transpose_w=transpose_w, return_gathered=expose,
        algorithm=ALGORITHMS[self.all_gather_algorithm],
        layout=self._layout())
    if not return_gathered:
      return outs[0]
    # Without a verified layout the gathered operand comes from XLA instead.
    return tuple(outs) if expose else (outs[0], all_gather_tokens(x, axis_name))

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w):
    from jax_comm_gemm import ffi_ops  # noqa: PLC0415

    if self.reduce_scatter == "xla" or lax.axis_size(axis_name) == 1:
      return XlaBackend().matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w)
    if self.reduce_scatter == "ring":
      return ring_matmul_reduce_scatter(x, w, axis_name, transpose_w)
    return ffi_ops.matmul_reduce_scatter(
        x, w, axis_name, transpose_w=transpose_w,
        algorithm=ALGORITHMS[self.reduce_scatter])

  def gathered_reuse(self, axis_size, dtype):
    from jax_comm_gemm.registry import REGISTRY  # noqa: PLC0415

    return REGISTRY.gathered_reuse(axis_size, self.all_gather_algorithm,
                                   jnp.dtype(dtype), self.gathered_layout)

  def _layout(self) -> str:
    from jax_comm_gemm.registry import REGISTRY  # noqa: PLC0415

    return self.gathered_layout or REGISTRY.default_layout()


def resolve_backend(config: CommGemmConfig) -> Backend:
  """The backend for `config` here and now (trace time; cheap after the first call)."""
  from jax_comm_gemm.registry import REGISTRY  # noqa: PLC0415

  forced = os.environ.get(ENV_BACKEND, "").strip().lower()
  if forced and forced not in BACKENDS:
    raise ValueError(
        f"environment variable {ENV_BACKEND}={forced!r}: allowed values are {BACKENDS}")
  if forced == "xla":
    return XlaBackend()
  choice = forced or config.backend
  if isinstance(choice, Backend):
    return choice
  if choice == "xla":
    return XlaBackend()
  status = REGISTRY.cublasmp_status()
  if not status.ok:
    if choice == "cublasmp":
      raise RuntimeError(
          f"backend='cublasmp' was requested but cuBLASMp is unavailable: {status.reason}")
    return XlaBackend()
  return CublasMpBackend(config.all_gather_algorithm, config.reduce_scatter,
                         config.gathered_layout)
