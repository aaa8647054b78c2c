"""Which backend runs a layer under the routing plan in force, and why (trace
time: reads of the plan, runtime/plan.py). The per-layer report asks the same
function."""

from __future__ import annotations

import dataclasses
import warnings

import jax

from jax_comm_gemm import validation
from jax_comm_gemm.backends.auto import AutoBackend, workspace
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.cublasmp import CublasMpBackend
from jax_comm_gemm.backends.xla import PLAIN_BACKENDS, XlaBackend
from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.capability import cublasmp_refusal
from jax_comm_gemm.runtime.registry import current_plan


@dataclasses.dataclass(frozen=True)
class Choice:
  """A backend, and why it runs the layer.

  >>> from jax_comm_gemm.backends.xla import XlaBackend
  >>> Choice(XlaBackend(), "backend='xla' was requested").backend.name
  'xla'
  """
  backend: Backend
  reason: str


def choose_backend(config, axis_name: str, mesh=None, precision=None) -> Choice:
  """The backend for `config` (a ``CommGemmConfig``) on `axis_name` of `mesh`
  (default: the mesh of the enclosing shard_map or ``jax.set_mesh``), with the
  reason, under the routing plan in force. Says once if the config's fused-op
  options do nothing there. The fused ops compute in float32: for a
  `precision` other than the default "auto" takes XLA, "cublasmp" refuses it.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> choose_backend(jcg.CommGemmConfig(backend="xla"), "tp", mesh).reason
  "backend='xla' was requested"
  """
  choice = _choose(config, axis_name, mesh, current_plan(), precision)
  if isinstance(choice.backend, XlaBackend):  # RingBackend included
    unused = [f"{name}={getattr(config, name)!r}" for name, default in fused_defaults()
              if getattr(config, name) != default]
    if unused:
      warnings.warn(f"jax_comm_gemm: CommGemmConfig({', '.join(unused)}) has no effect: "
                    f"the layers run on XLA's collectives ({choice.reason})",
                    RuntimeWarning, stacklevel=3)
  return choice


def fused_defaults() -> tuple[tuple[str, object], ...]:
  """(field, default) of the options only the fused ops read: the fields of
  ``CublasMpBackend``, whose defaults ``CommGemmConfig`` takes too."""
  return tuple((f.name, f.default) for f in dataclasses.fields(CublasMpBackend))


def _choose(config, axis_name, mesh, plan, precision) -> Choice:
  forced = plan.settings.backend
  requested = forced or config.backend
  asked = (f"{settings.BACKEND}={forced}" if forced else f"backend={requested!r}")
  if forced in PLAIN_BACKENDS:
    return Choice(PLAIN_BACKENDS[forced](), f"forced by {asked}")
  if isinstance(requested, Backend):
    if isinstance(requested, (CublasMpBackend, AutoBackend)):
      validation.check_precision_used(asked, precision, _FLOAT32)
    return Choice(requested, "a Backend instance was given")
  if requested in PLAIN_BACKENDS:
    return Choice(PLAIN_BACKENDS[requested](), f"{asked} was requested")
  if not plan.cublasmp.ok:
    if requested == "cublasmp":
      raise RuntimeError(
          f"{asked} was requested but cuBLASMp is unavailable: {plan.cublasmp.reason}")
    return Choice(XlaBackend(), f"cuBLASMp is unavailable: {plan.cublasmp.reason}")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if axis_name in mesh.axis_names and mesh.shape[axis_name] == 1:
    return Choice(XlaBackend(), f"axis {axis_name!r} has size 1: nothing to communicate")
  if axis_name not in mesh.axis_names or plan.comm_id(mesh, axis_name) is None:
    why = (f"mesh axis {axis_name!r} is not connected: call "
           f"jax_comm_gemm.connect(mesh, {axis_name!r}) in every process before tracing; "
           "a program traced now keeps XLA's collectives after connect")
    if requested == "cublasmp":
      raise RuntimeError(f"{asked}: {why}")
    warnings.warn(f"jax_comm_gemm: {why}; using XLA's collectives until then",
                  RuntimeWarning, stacklevel=3)
    return Choice(XlaBackend(), why)
  if not validation.default_precision(precision):
    if requested == "cublasmp":
      validation.check_precision_used(asked, precision, _FLOAT32)
    return Choice(XlaBackend(), f"precision={precision!r}: {_FLOAT32}; XLA's GEMMs take it")
  fused = config.fused
  found = workspace(mesh.shape[axis_name], plan)
  if requested == "cublasmp":
    why = cublasmp_refusal(fused, found, asked)
    if why:
      raise RuntimeError(why)
    return Choice(fused, f"{asked}: {plan.cublasmp.reason}, axis {axis_name!r} connected")
  return Choice(AutoBackend(fused), f"{asked}: per problem, the fastest measured "
                                    f"({plan.cublasmp.reason}, axis {axis_name!r} connected"
                                    + ("" if found.ok else f"; {found.reason}") + ")")


_FLOAT32 = "the fused ops compute in float32 (CUBLAS_COMPUTE_32F)"


def resolve_backend(config, axis_name: str = "tp", mesh=None, precision=None) -> Backend:
  """The backend of :func:`choose_backend`, without the reason.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> resolve_backend(jcg.CommGemmConfig(backend="ring"), "tp", mesh).name
  'ring'
  """
  return choose_backend(config, axis_name, mesh, precision).backend
