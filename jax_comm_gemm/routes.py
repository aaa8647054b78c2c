"""Routing decisions of the collective matmuls that are not the backend's:
where a weight gradient gets its gathered operand, and whether the ops run in
FP8. Each is
decided here, at trace time, from the routing plan in force; the custom_vjps
(collective_matmul.py) and the per-layer report (diagnostics/report.py) ask
the same functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax

import jax_comm_gemm.backends.auto as auto
from jax_comm_gemm.backends import Backend
from jax_comm_gemm.config import FP8_BACKENDS
from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.capability import cublasmp_refusal
from jax_comm_gemm.runtime.registry import current_plan


@dataclasses.dataclass(frozen=True)
class GatheredRoute:
  """Where a weight gradient gets its gathered operand: from the fused op
  (``reuse``) or from a ``lax.all_gather``, and why.

  >>> GatheredRoute(False, "reuse_gathered=False was requested").reuse
  False
  """
  reuse: bool
  reason: str


def gathered_route(backend: Backend, reuse_gathered: bool | None, axis_size: int, dtype,
                   transpose_w: bool) -> GatheredRoute:
  """The one place that decides whether an AllGather+GEMM hands out its gathered
  operand (an AllGather+GEMM with `transpose_w`, in `dtype`, over `axis_size`).

  >>> from jax_comm_gemm.backends import XlaBackend
  >>> gathered_route(XlaBackend(), None, 2, "bfloat16", False).reason
  "XLA's all_gather result is an ordinary array"
  """
  if reuse_gathered is False:
    return GatheredRoute(False, "reuse_gathered=False was requested")
  verdict = backend.gathered_reuse(axis_size, dtype, transpose_w)
  return GatheredRoute(verdict.ok, verdict.reason)


@dataclasses.dataclass(frozen=True)
class Fp8Route:
  """Whether the collective matmuls run in FP8 (``fp8``), and why; `backend`
  is what their fused steps run on: "xla", "ring" or "auto" (per problem).

  >>> Fp8Route(False, "no FP8 recipe").fp8
  False
  """
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
