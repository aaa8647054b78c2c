"""Which backend runs a layer here and now, and why (trace time; a few dict
reads after the first call). The per-layer report asks the same function."""

from __future__ import annotations

import dataclasses
import warnings

import jax

from jax_comm_gemm.backends.auto import AutoBackend
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.cublasmp import CublasMpBackend
from jax_comm_gemm.backends.xla import PLAIN_BACKENDS, XlaBackend
from jax_comm_gemm.runtime import REGISTRY, settings


@dataclasses.dataclass(frozen=True)
class Choice:
  backend: Backend
  reason: str


def choose_backend(config, axis_name: str, mesh=None) -> Choice:
  """The backend for `config` (a ``CommGemmConfig``) on `axis_name` of `mesh`
  (default: the mesh of the enclosing shard_map or ``jax.set_mesh``), with the
  reason. Says once if the config's cuBLASMp options do nothing there."""
  choice = _choose(config, axis_name, mesh)
  if isinstance(choice.backend, XlaBackend):  # RingBackend included
    unused = [f"{name}={getattr(config, name)!r}" for name, default in _FUSED_OPTIONS
              if getattr(config, name) != default]
    if unused:
      warnings.warn(f"jax_comm_gemm: CommGemmConfig({', '.join(unused)}) has no effect: "
                    f"the layers run on XLA's collectives ({choice.reason})",
                    RuntimeWarning, stacklevel=3)
  return choice


# The config fields that only the cuBLASMp backend reads, with their defaults.
_FUSED_OPTIONS = (("all_gather_algorithm", "split_p2p"), ("reduce_scatter", "xla"),
                  ("gathered_layout", None))


def _choose(config, axis_name, mesh) -> Choice:
  forced = settings.backend_override()
  requested = forced or config.backend
  if forced in PLAIN_BACKENDS:
    return Choice(PLAIN_BACKENDS[forced](), f"forced by {settings.BACKEND}={forced}")
  if isinstance(requested, Backend):
    return Choice(requested, "a Backend instance was given")
  if requested in PLAIN_BACKENDS:
    return Choice(PLAIN_BACKENDS[requested](), f"backend={requested!r} was requested")
  status = REGISTRY.cublasmp_status()
  if not status.ok:
    if requested == "cublasmp":
      raise RuntimeError(
          f"backend='cublasmp' was requested but cuBLASMp is unavailable: {status.reason}")
    return Choice(XlaBackend(), f"cuBLASMp is unavailable: {status.reason}")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if axis_name in mesh.axis_names and mesh.shape[axis_name] == 1:
    return Choice(XlaBackend(), f"axis {axis_name!r} has size 1: nothing to communicate")
  if axis_name not in mesh.axis_names or REGISTRY.comm_id(mesh, axis_name) is None:
    why = (f"mesh axis {axis_name!r} is not connected: call "
           f"jax_comm_gemm.connect(mesh, {axis_name!r}) in every process before tracing")
    if requested == "cublasmp":
      raise RuntimeError(f"backend='cublasmp': {why}")
    warnings.warn(f"jax_comm_gemm: {why}; using XLA's collectives", RuntimeWarning,
                  stacklevel=3)
    return Choice(XlaBackend(), why)
  fused = CublasMpBackend(config.all_gather_algorithm, config.reduce_scatter,
                          config.gathered_layout)
  if requested == "cublasmp":
    return Choice(fused, f"backend='cublasmp': {status.reason}, axis {axis_name!r} connected")
  return Choice(AutoBackend(fused), f"backend='auto': per problem, the fastest measured "
                                    f"({status.reason}, axis {axis_name!r} connected)")


def resolve_backend(config, axis_name: str = "tp", mesh=None) -> Backend:
  """The backend of :func:`choose_backend`, without the reason."""
  return choose_backend(config, axis_name, mesh).backend
