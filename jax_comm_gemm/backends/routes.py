"""Every routing decision of a collective matmul, at trace time, from the
routing plan in force (runtime/plan.py): which backend runs a layer
(:func:`choose_backend`), where a weight gradient gets its gathered operand
(:func:`gathered_route`), and whether and on what the ops run in FP8
(:func:`fp8_route`, :func:`fp8_collectives`). The custom_vjps
(collective_matmul.py) and the per-layer report (diagnostics/report.py) ask
these same functions; nothing else decides a route.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
from jax import lax

import jax_comm_gemm.backends.auto as auto
from jax_comm_gemm import validation
from jax_comm_gemm.backends.auto import AutoBackend, workspace
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.backends.xla import PLAIN_BACKENDS, XlaBackend
from jax_comm_gemm.config import FP8_BACKENDS
from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.capability import cublasmp_refusal
from jax_comm_gemm.runtime.registry import current_plan


@dataclasses.dataclass(frozen=True)
class Choice:
  """A backend, and why it runs the layer (what :func:`choose_backend` returns).

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> choice = choose_backend(jcg.CommGemmConfig(), "tp", mesh)  # auto, on a CPU
  >>> choice.backend.name, choice.reason.startswith("cuBLASMp is unavailable")
  ('xla', True)
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


@dataclasses.dataclass(frozen=True)
class GatheredRoute:
  """Where a weight gradient gets its gathered operand: from the fused op
  (``reuse``) or from a ``lax.all_gather``, and why."""
  reuse: bool
  reason: str


def gathered_route(backend: Backend, reuse_gathered: bool | None, axis_size: int, dtype,
                   transpose_w: bool) -> GatheredRoute:
  """The one place that decides whether an AllGather+GEMM hands out its gathered
  operand (an AllGather+GEMM with `transpose_w`, in `dtype`, over `axis_size`).

  >>> gathered_route(XlaBackend(), None, 2, "bfloat16", False).reason
  "XLA's all_gather result is an ordinary array"
  """
  if reuse_gathered is False:
    return GatheredRoute(False, "reuse_gathered=False was requested")
  verdict = backend.gathered_reuse(axis_size, dtype, transpose_w)
  return GatheredRoute(verdict.ok, verdict.reason)


@dataclasses.dataclass(frozen=True)
class OpRoute:
  """How one bf16 collective matmul runs, decided once where it is called:
  the backend of its forward op and of its backward's other op (concrete:
  ``backend="auto"``'s choices already made), and where each AllGather+GEMM's
  gathered operand comes from. The custom_vjps read it; none re-derives it.
  """
  forward: Backend
  backward: Backend
  gathered_forward: GatheredRoute   # the AllGather+GEMM of the forward (AG)
  gathered_backward: GatheredRoute  # the AllGather+GEMM of the backward (RS)


def op_route(config, op: str, x, w, transpose_w: bool, axis_name: str, precision=None,
             hands_out: bool = False) -> OpRoute:
  """The :class:`OpRoute` of op `op` (``auto.AG`` or ``auto.RS``) on local `x`
  and `w` under the plan in force; `hands_out`: an AllGather+GEMM whose
  gathered operand is used (returned, or kept for the weight gradient).
  Call inside ``jax.shard_map`` (it reads the axis size)."""
  backend = resolve_backend(config, axis_name, precision=precision)
  size = lax.axis_size(axis_name)
  m = w.shape[0] if transpose_w else w.shape[1]
  rows = x.shape[0] * size if op == auto.AG else x.shape[0] // size
  # The gradient of y: the backward op's x, y's shape and dtype.
  dy = jax.ShapeDtypeStruct((rows, m), x.dtype)
  # An AllGather+GEMM's route: forward for AG, the backward's for RS.
  gathered = gathered_route(backend, config.reuse_gathered, size, x.dtype,
                            transpose_w if op == auto.AG else not transpose_w)
  no_reuse = GatheredRoute(False, "no AllGather+GEMM there")

  def concrete(which, *operands, gathered=False):
    if isinstance(backend, AutoBackend):
      return backend.chosen(which, *operands, axis_name, gathered)
    return backend

  if op == auto.AG:
    return OpRoute(concrete(auto.AG, x, w, transpose_w, gathered=hands_out and gathered.reuse),
                   concrete(auto.RS, dy, w, not transpose_w), gathered, no_reuse)
  return OpRoute(concrete(auto.RS, x, w, transpose_w),
                 concrete(auto.AG, dy, w, not transpose_w, gathered=gathered.reuse),
                 no_reuse, gathered)


@dataclasses.dataclass(frozen=True)
class Fp8Route:
  """Whether the collective matmuls run in FP8 (``fp8``), and why; `backend`
  is what their fused steps run on: "xla", "ring", "cublasmp" or "auto" (per
  problem)."""
  fp8: bool
  reason: str
  backend: str = ""


def fp8_route(config) -> Fp8Route:
  """Whether `config`'s ops run in FP8 under the plan in force: where it holds
  a recipe. FP8's fused steps run on XLA's collectives, the ring or the
  extension's fused FP8 ops (:func:`fp8_collectives`), so a backend that
  ``JAX_COMM_GEMM_BACKEND`` forces and that is none of them is an error here
  (``CommGemmConfig`` refuses such a ``backend`` itself).

  >>> import jax_comm_gemm as jcg
  >>> from jax_comm_gemm.fp8 import Fp8Recipe
  >>> fp8_route(jcg.CommGemmConfig(backend="xla", fp8=Fp8Recipe())).reason
  "FP8 (tensor scaling) on XLA's collectives: FP8 bytes on the wire, the gathered grad_output reused"
  """
  if config.fp8 is None:
    return Fp8Route(False, "no FP8 recipe")
  forced = current_plan().settings.backend
  if forced not in ("", *FP8_BACKENDS):
    raise RuntimeError(f"{settings.BACKEND}={forced} cannot run CommGemmConfig.fp8: FP8 "
                       f"runs on XLA's collectives, the ring or the fused ops (docs/fp8.md); "
                       f"unset it or set it to one of {FP8_BACKENDS}")
  reuse = ("the gathered grad_output gathered again (reuse_gathered=False)"
           if config.reuse_gathered is False else "the gathered grad_output reused")
  backend = _fp8_backend(config)
  where = {"ring": "on the ring (per-shard FP8 GEMMs overlapped with ppermutes)",
           "xla": "on XLA's collectives",
           "cublasmp": (f"on the fused FP8 ops ({config.all_gather_algorithm}; "
                        f"reduce-scatter {config.reduce_scatter})")}.get(
      backend, "per shape on XLA's collectives, the ring or the fused ops, as autotune "
               "measured")
  return Fp8Route(True, f"FP8 ({config.fp8.scaling} scaling) {where}: FP8 bytes on the "
                        f"wire, {reuse}", backend)


def _fp8_backend(config) -> str:
  """The backend FP8 runs on: ``JAX_COMM_GEMM_BACKEND`` if it forces one, else
  the config's (one of ``FP8_BACKENDS``)."""
  forced = current_plan().settings.backend
  return forced if forced in FP8_BACKENDS and forced != "auto" else config.backend


def fp8_collectives(config, op: str, x, w, transpose_w: bool, axis_name: str,
                    gathered: bool = False) -> tuple[Any, str]:
  """(collectives, why) for FP8 op `op` (``backends.auto.AG`` or ``RS``) on
  `x` and `w`: "xla" or "ring", or for backend "cublasmp" a CublasMpBackend of
  the config's algorithms (the extension's fused FP8 ops), as the backend
  names it, else as ``backend="auto"`` chooses for the problem, whose key
  carries the recipe (autotune's measurement in the plan, or XLA's).

  >>> import jax_comm_gemm as jcg
  >>> from jax_comm_gemm.fp8 import Fp8Recipe
  >>> fp8_collectives(jcg.CommGemmConfig(backend="ring", fp8=Fp8Recipe()), auto.AG, None,
  ...                 None, False, "tp")
  ('ring', "backend='ring'")
  """
  backend = _fp8_backend(config)
  if backend in ("xla", "ring"):
    return backend, f"backend={backend!r}"
  fused = config.fused
  if backend == "cublasmp":
    why = cublasmp_refusal(fused, auto.workspace(lax.axis_size(axis_name)),
                           "backend='cublasmp' (FP8)")
    if why:
      raise RuntimeError(why)
    return fused, "backend='cublasmp'"
  p = auto.problem(op, x, w, transpose_w, axis_name, gathered=gathered, fp8=config.fp8.key)
  name, why = auto.choose(p, "xla")
  runs = auto.runnable(name, p)
  if not runs.ok:  # forced by the environment where it cannot run
    return "xla", f"{why}; {name} cannot run it ({runs.reason}): XLA's collectives"
  return auto.fp8_collectives_of(name, fused), why
