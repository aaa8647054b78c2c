"""Every routing decision of a collective matmul, made at trace time from the
routing plan in force: which backend runs a layer (:func:`choose_backend`),
for ``backend="auto"`` which implementation runs each problem (:func:`choose`,
:class:`AutoBackend`), where a weight gradient gets its gathered operand
(:func:`gathered_route`), all of them as one value per op (:func:`op_route`),
and FP8's route (:func:`fp8_route`, :func:`fp8_collectives`). Nothing else
decides a route, and nothing here writes. ``auto``'s order: the implementation
``JAX_COMM_GEMM_AUTOTUNE`` forces, else autotune's measurement, else XLA under
``FUSED_FROM_FLOP`` per GPU and the configured fused algorithm above
(docs/design.md#backendauto-and-autotuning). Longer than 300 lines: the routing is one job."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import jax_comm_gemm.backends.pallas as pallas
from jax_comm_gemm import validation
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.primitives import CublasMpBackend, unbound
from jax_comm_gemm.backends.xla import PLAIN_BACKENDS, XlaBackend
from jax_comm_gemm.config import DEFAULT_CONFIG, FP8_BACKENDS, CommGemmConfig
from jax_comm_gemm.fp8.recipe import Fp8Recipe
from jax_comm_gemm.fp8.steps import why_not_fused
from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.capability import (Capability, WorkspaceKey, algorithm_refusal,
                                              cublasmp_refusal, symmetric_memory)
from jax_comm_gemm.runtime.constants import OWN_ALGORITHMS
from jax_comm_gemm.runtime.plan import Plan
from jax_comm_gemm.runtime.registry import current_plan

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
# What autotune measures, per op, XLA first (the others are checked against it).
# "cublasmp_<algorithm>": cuBLASMp's fused op; "pallas_mgpu": jax's Mosaic GPU kernel.
CANDIDATES = {
    AG: ("xla", "ring", "cublasmp_default", "cublasmp_split_p2p", "pipelined_ce", pallas.NAME),
    RS: ("xla", "ring", "cublasmp_default", "cublasmp_split_p2p", "pipelined_ce"),
}
# An FP8 problem's: jax's Pallas kernel has no FP8 (docs/fp8.md).
FP8_CANDIDATES = {op: tuple(n for n in names if n != pallas.NAME)
                  for op, names in CANDIDATES.items()}
# Every name JAX_COMM_GEMM_AUTOTUNE may force (a test holds it equal to CANDIDATES').
IMPLEMENTATIONS = settings.IMPLEMENTATIONS
# FLOP per GPU from which the rule of thumb fuses (docs/performance.md).
FUSED_FROM_FLOP = 1.0e11


@dataclasses.dataclass(frozen=True)
class Problem:
  op: str
  rows: int  # local rows of x
  k: int
  m: int     # output features of the local GEMM
  dtype: str
  transpose_w: bool
  axis_size: int
  # An AllGather+GEMM whose gathered operand is an output too: it costs the
  # implementations unlike amounts, so it is a problem of its own.
  gathered: bool = False
  fp8: str = ""  # the Fp8Recipe's key where the op runs in FP8

  def flop(self) -> float:
    gathered = self.rows * (self.axis_size if self.op == AG else 1)
    return 2.0 * gathered * self.k * self.m

  def text(self) -> str:
    return (f"{self.op} rows={self.rows} k={self.k} m={self.m} {self.dtype} "
            f"{'TN' if self.transpose_w else 'NN'} P={self.axis_size}"
            + (" +gathered" if self.gathered else "") + (f" {self.fp8}" if self.fp8 else ""))


def problem(op: str, x, w, transpose_w: bool, axis_name: str, gathered: bool = False,
            fp8: str = "") -> Problem:
  m = w.shape[0] if transpose_w else w.shape[1]
  return Problem(op, int(x.shape[0]), int(x.shape[1]), int(m), jnp.dtype(x.dtype).name,
                 bool(transpose_w), int(lax.axis_size(axis_name)), bool(gathered), fp8)


def candidates(p: Problem) -> tuple[str, ...]:
  """What autotune measures for `p`, XLA first."""
  return (FP8_CANDIDATES if p.fp8 else CANDIDATES)[p.op]


def workspace(axis_size: int, plan) -> Capability:
  """Whether cuBLASMp got its workspace on groups of `axis_size` (connect's
  probe, in `plan`)."""
  return plan.verdict(WorkspaceKey(int(axis_size)))


def _refusal(name: str, axis_size: int, plan) -> str | None:
  """Why `name` cannot run at all on groups of `axis_size`, or None: cuBLASMp's
  algorithms need its workspace, split_p2p and jax's Pallas kernel NCCL symmetric
  memory (the workspace probe; where it is plain, cuBLASMp's default runs)."""
  verdict = workspace(axis_size, plan)
  if name.startswith("cublasmp_"):
    return algorithm_refusal(name.removeprefix("cublasmp_"), verdict)
  if name != pallas.NAME or symmetric_memory(verdict):
    return None
  return f"jax's Pallas kernel needs NCCL symmetric memory too: {verdict.reason}"


def runnable(name: str, p: Problem, plan) -> Capability:
  """Whether implementation `name` can run `p` as itself. The Pallas kernel
  has limits (where it cannot, its backend runs XLA's ops), and so do the
  fused FP8 ops (where they cannot, FP8 runs on XLA's collectives); neither
  it nor cuBLASMp's algorithms run where cuBLASMp was refused its workspace."""
  refused = _refusal(name, p.axis_size, plan)
  if refused:
    return Capability(False, refused)
  if p.fp8 and name not in PLAIN_BACKENDS:
    why = why_not_fused(Fp8Recipe.from_key(p.fp8), (p.m, p.k))
    if why is not None:
      return Capability(False, why)
  if name == pallas.NAME:
    return pallas.supports(p.rows, p.k, p.m, p.dtype, p.transpose_w, p.gathered,
                           p.axis_size)
  return Capability(True, f"{name} runs every problem")


def choose(p: Problem, default: str, plan) -> tuple[str, str]:
  """(implementation, why) for `p` under `plan`; `default` is the configured
  fused one."""
  mode = plan.settings.autotune
  if mode in candidates(p):
    verdict = runnable(mode, p, plan)
    return ("xla" if _refusal(mode, p.axis_size, plan) else mode), (
        f"forced by {settings.AUTOTUNE}={mode}" +
        ("" if verdict.ok else f", which runs XLA's ops here: {verdict.reason}"))
  if plan.problems is not None:
    plan.problems.append(p)
  decided = plan.decision(p) if mode == "on" else None
  if decided is not None:  # a cached choice may name what cannot run here
    return _or_xla(*decided, p, plan)
  why = "measuring is off" if mode == "off" else "not measured yet (jax_comm_gemm.backends.autotune)"
  # Only where measuring could choose otherwise: autotune measures here (it
  # needs the extension) and more than one candidate runs.
  if (mode == "on" and plan.problems is None and p.axis_size > 1 and plan.cublasmp.ok
      and sum(runnable(c, p, plan).ok for c in candidates(p)) > 1):
    warnings.warn(f"jax_comm_gemm: {p.text()} is not measured: the rule of thumb routes it, "
                  "and a program traced now keeps that route when autotune measures it "
                  "later; autotune before tracing (jax_comm_gemm.backends.autotune(mesh, axis, "
                  "jax_comm_gemm.backends.problems_of(step, *args))), or run the step that "
                  "autotune_step returns", RuntimeWarning, stacklevel=2)
  if p.fp8:
    return "xla", f"{why}; FP8 runs on XLA's collectives unless another measured faster"
  if p.flop() < FUSED_FROM_FLOP:
    return "xla", f"{why}; rule of thumb: {p.flop():.2g} FLOP per GPU is too small to fuse"
  return _or_xla(default, f"{why}; rule of thumb: {p.flop():.2g} FLOP per GPU, fused", p, plan)


def _or_xla(name: str, why: str, p: Problem, plan) -> tuple[str, str]:
  refused = _refusal(name, p.axis_size, plan)
  return (name, why) if refused is None else ("xla", f"{why}; {name} cannot run: {refused}")


def implementation(name: str, template: CublasMpBackend) -> Backend:
  """The backend that runs implementation `name`."""
  if name in PLAIN_BACKENDS:
    return PLAIN_BACKENDS[name]()
  if name == pallas.NAME:
    return pallas.PallasBackend()
  algorithm = name.removeprefix("cublasmp_")
  return dataclasses.replace(template, all_gather_algorithm=algorithm,
                             reduce_scatter=algorithm)


def fp8_collectives_of(name: str, template: CublasMpBackend):
  """An FP8 op's `collectives` for implementation `name`: "xla" or "ring", or
  the fused backend of `name` (its algorithms in `template`'s place)."""
  return name if name in PLAIN_BACKENDS else implementation(name, template)


@dataclasses.dataclass(frozen=True)
class AutoBackend(Backend):
  """Runs each op with :func:`choose`'s implementation; `fused` carries the
  configured algorithms, used where the fused op is chosen by rule of thumb.
  `plan`: the plan it chooses under (:func:`bound` sets it where the route
  is decided; its methods never read the plan in force, and one called with
  no plan bound is an error that says how to bind one).

  >>> AutoBackend(CublasMpBackend(all_gather_algorithm="pipelined_ce")).fused.all_gather_algorithm
  'pipelined_ce'
  """

  fused: CublasMpBackend = CublasMpBackend()
  plan: Plan | None = dataclasses.field(default=None, repr=False)

  name = "auto"

  def default(self, op: str) -> str:
    """The implementation the rule of thumb fuses op `op` (AG or RS) with: the
    configured algorithm."""
    configured = (self.fused.all_gather_algorithm if op == AG else self.fused.reduce_scatter)
    return (configured if configured in PLAIN_BACKENDS or configured in OWN_ALGORITHMS
            else f"cublasmp_{configured}")

  def _plan(self) -> Plan:
    """The plan it chooses under: the one bound where the route was decided."""
    if self.plan is None:
      raise RuntimeError(unbound(self))
    return self.plan

  def chosen(self, op: str, x, w, transpose_w, axis_name, gathered=False) -> Backend:
    """The backend that runs op `op` (AG or RS) on these operands (arrays or
    their shapes), `gathered`: an AllGather+GEMM that hands out its operand."""
    plan = self._plan()
    name, _ = choose(problem(op, x, w, transpose_w, axis_name, gathered), self.default(op), plan)
    return implementation(name, bound(self.fused, plan))

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    return self.chosen(AG, x, w, transpose_w, axis_name, return_gathered).all_gather_matmul(
        x, w, axis_name, transpose_w=transpose_w, return_gathered=return_gathered,
        precision=precision)

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    return self.chosen(RS, x, w, transpose_w, axis_name).matmul_reduce_scatter(
        x, w, axis_name, transpose_w=transpose_w, precision=precision)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    # XLA and the ring hand out the gathered operand as an ordinary array;
    # every fused algorithm that may be chosen must have passed the self-test
    # (those that cannot run here are never chosen).
    plan = self._plan()
    for name in CANDIDATES[AG]:
      if name not in PLAIN_BACKENDS and _refusal(name, axis_size, plan) is None:
        verdict = implementation(name, bound(self.fused, plan)).gathered_reuse(
            axis_size, dtype, transpose_w)
        if not verdict.ok:
          return verdict
    return Capability(True, "every implementation auto may choose hands it out")


def fused_backend(config) -> CublasMpBackend:
  """The fused ops with `config`'s algorithms.

  >>> import jax_comm_gemm as jcg
  >>> fused_backend(jcg.CommGemmConfig(all_gather_algorithm="pipelined_ce")).all_gather_algorithm
  'pipelined_ce'
  """
  return CublasMpBackend(config.all_gather_algorithm, config.reduce_scatter)


def init_config(config: CommGemmConfig, initializing: bool) -> CommGemmConfig:
  """`config`, on XLA's collectives while a module is `initializing`: an init's
  forward only makes the parameters' shapes (its output is dropped), so it
  chooses no route (nor warns that one is not measured) and compiles no fused
  call into the init program.

  >>> import jax_comm_gemm as jcg
  >>> init_config(jcg.CommGemmConfig(), initializing=True).backend
  'xla'
  """
  if initializing and config.backend != "xla":
    # Only the backend and the FP8 recipe: the fused ops' options mean nothing on XLA.
    return CommGemmConfig(backend="xla", reuse_gathered=config.reuse_gathered, fp8=config.fp8)
  return config


def given(plan, where: str) -> Plan:
  """`plan`, the routing plan a caller below an entry was passed; None (a
  caller that forgot it) is an error, never a read of the plan in force.

  >>> given(None, "op_route")
  Traceback (most recent call last):
  ...
  TypeError: op_route: `plan` is the routing plan the entry read (a layer's, an op's, jax_comm_gemm.runtime.REGISTRY.plan()) and passes down; got None
  """
  if not isinstance(plan, Plan):
    raise TypeError(f"{where}: `plan` is the routing plan the entry read (a layer's, an "
                    f"op's, jax_comm_gemm.runtime.REGISTRY.plan()) and passes down; got {plan!r}")
  return plan


def bound(backend: Backend, plan: Plan) -> Backend:
  """`backend`, choosing and binding under `plan` where it reads a plan (the
  fused ops' verdicts and layout, auto's choices) and has none of its own: a
  route carries it, so an op traced later (the backward of a ``jax.vjp``, under
  another plan or none) binds as the route was decided."""
  if isinstance(backend, CublasMpBackend) and backend.plan is None:
    return dataclasses.replace(backend, plan=plan)
  if isinstance(backend, AutoBackend) and backend.plan is None:
    return dataclasses.replace(backend, fused=bound(backend.fused, plan), plan=plan)
  return backend


# --- the backend a layer takes, the route of one op, the FP8 route ------------------------

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


def choose_backend(config, axis_name: str, mesh=None, precision=None, plan=None) -> Choice:
  """The backend for `config` (a ``CommGemmConfig``) on `axis_name` of `mesh`
  (default: the mesh of the enclosing shard_map or ``jax.set_mesh``), with the
  reason, under `plan`, bound to it. A user's entry: with no `plan` it reads
  the routing plan in force, once (the library's own callers pass theirs). Says
  once if the config's fused-op options do nothing there. The fused ops compute in float32: for a
  `precision` other than the default "auto" takes XLA, "cublasmp" refuses it.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> choose_backend(jcg.CommGemmConfig(backend="xla"), "tp", mesh).reason
  "backend='xla' was requested"
  """
  plan = current_plan() if plan is None else plan  # a user's entry (the library passes it)
  choice = _choose(config, axis_name, mesh, plan, precision)
  if isinstance(choice.backend, XlaBackend):  # RingBackend included
    # The options only the fused ops read (FUSED_OPTIONS), set to other than
    # the config's defaults.
    unused = [f"{name}={getattr(config, name)!r}" for name in FUSED_OPTIONS
              if getattr(config, name) != getattr(DEFAULT_CONFIG, name)]
    if unused:
      warnings.warn(f"jax_comm_gemm: CommGemmConfig({', '.join(unused)}) has no effect: "
                    f"the layers run on XLA's collectives ({choice.reason})",
                    RuntimeWarning, stacklevel=3)
  return Choice(bound(choice.backend, plan), choice.reason)


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
  fused = fused_backend(config)
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
# The config's options that only the fused ops read.
FUSED_OPTIONS = ("all_gather_algorithm", "reduce_scatter")


def resolve_backend(config, axis_name: str = "tp", mesh=None, precision=None,
                    plan=None) -> Backend:
  """The backend of :func:`choose_backend`, without the reason, bound to `plan`
  (default: the plan in force): its ops bind under it wherever they are called.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> resolve_backend(jcg.CommGemmConfig(backend="ring"), "tp", mesh).name
  'ring'
  """
  return choose_backend(config, axis_name, mesh, precision, plan).backend


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
  gathered operand comes from. The custom_vjps read it; none re-derives it,
  and the backends carry the plan that decided it (their layout and verdicts).
  """
  forward: Backend
  backward: Backend
  gathered_forward: GatheredRoute   # the AllGather+GEMM of the forward (AG)
  gathered_backward: GatheredRoute  # the AllGather+GEMM of the backward (RS)


def op_route(config, op: str, x, w, transpose_w: bool, axis_name: str, precision,
             hands_out: bool, plan: Plan) -> OpRoute:
  """The :class:`OpRoute` of op `op` (``AG`` or ``RS``) on local `x`
  and `w` under `plan`, its backends bound to it (:func:`bound`); `hands_out`:
  an AllGather+GEMM whose gathered operand is used (returned, or kept for the
  weight gradient). Call inside ``jax.shard_map`` (it reads the axis size)."""
  backend = resolve_backend(config, axis_name, precision=precision,
                            plan=given(plan, "op_route"))
  size = lax.axis_size(axis_name)
  m = w.shape[0] if transpose_w else w.shape[1]
  rows = x.shape[0] * size if op == AG else x.shape[0] // size
  # The gradient of y: the backward op's x, y's shape and dtype.
  dy = jax.ShapeDtypeStruct((rows, m), x.dtype)
  # An AllGather+GEMM's route: forward for AG, the backward's for RS.
  gathered = gathered_route(backend, config.reuse_gathered, size, x.dtype,
                            transpose_w if op == AG else not transpose_w)
  no_reuse = GatheredRoute(False, "no AllGather+GEMM there")

  def concrete(which, *operands, gathered=False):
    if isinstance(backend, AutoBackend):
      return backend.chosen(which, *operands, axis_name, gathered)
    return backend

  if op == AG:
    return OpRoute(concrete(AG, x, w, transpose_w, gathered=hands_out and gathered.reuse),
                   concrete(RS, dy, w, not transpose_w), gathered, no_reuse)
  return OpRoute(concrete(RS, x, w, transpose_w),
                 concrete(AG, dy, w, not transpose_w, gathered=gathered.reuse),
                 no_reuse, gathered)


def heads_inside(config, dot_general) -> bool:
  """Whether the op takes attention's layout itself (`split_heads`,
  `merge_heads`): an FP8 recipe of one scale per tensor, whose casts read the
  arrays where they lie; elsewhere XLA's copies change the layout, as they do
  where a `dot_general` is injected."""
  return dot_general is None and config.fp8 is not None and config.fp8.per_tensor


@dataclasses.dataclass(frozen=True)
class Fp8Route:
  """Whether the collective matmuls run in FP8 (``fp8``), and why; `backend`
  is what their fused steps run on: "xla", "ring", "cublasmp" or "auto" (per
  problem)."""
  fp8: bool
  reason: str
  backend: str = ""


def fp8_route(config, plan: Plan) -> Fp8Route:
  """Whether `config`'s ops run in FP8 (where it holds a recipe), and why; a
  ``JAX_COMM_GEMM_BACKEND`` that FP8 cannot run on is an error here.

  >>> import jax_comm_gemm as jcg
  >>> from jax_comm_gemm.fp8 import Fp8Recipe
  >>> fp8_route(jcg.CommGemmConfig(backend="xla", fp8=Fp8Recipe()), jcg.runtime.REGISTRY.plan()).reason
  "FP8 (tensor scaling) on XLA's collectives: FP8 bytes on the wire, the gathered grad_output reused"
  """
  if config.fp8 is None:
    return Fp8Route(False, "no FP8 recipe")
  forced = plan.settings.backend
  if forced not in ("", *FP8_BACKENDS):
    raise RuntimeError(f"{settings.BACKEND}={forced} cannot run CommGemmConfig.fp8: FP8 "
                       f"runs on XLA's collectives, the ring or the fused ops (docs/fp8.md); "
                       f"unset it or set it to one of {FP8_BACKENDS}")
  reuse = ("the gathered grad_output gathered again (reuse_gathered=False)"
           if config.reuse_gathered is False else "the gathered grad_output reused")
  backend = _fp8_backend(config, plan)
  where = {"ring": "on the ring (per-shard FP8 GEMMs overlapped with ppermutes)",
           "xla": "on XLA's collectives",
           "cublasmp": (f"on the fused FP8 ops ({config.all_gather_algorithm}; "
                        f"reduce-scatter {config.reduce_scatter})")}.get(
      backend, "per shape, the fastest of XLA's collectives, the ring and the fused ops "
               "where autotune measured the shape, else XLA's collectives")
  return Fp8Route(True, f"FP8 ({config.fp8.scaling} scaling) {where}: FP8 bytes on the "
                        f"wire, {reuse}", backend)


def _fp8_backend(config, plan: Plan) -> str:
  """The backend FP8 runs on: ``JAX_COMM_GEMM_BACKEND`` if it forces one, else
  the config's (one of ``FP8_BACKENDS``)."""
  forced = plan.settings.backend
  return forced if forced in FP8_BACKENDS and forced != "auto" else config.backend


def fp8_collectives(config, op: str, x, w, transpose_w: bool, axis_name: str,
                    gathered: bool, plan: Plan) -> tuple[Any, str]:
  """(collectives, why) for FP8 op `op` on `x` and `w` under `plan`: "xla",
  "ring", or the fused FP8 ops (a CublasMpBackend of the config's algorithms,
  bound to `plan`), as the backend names it or, for "auto", as :func:`choose`
  picks for the problem.

  >>> import jax_comm_gemm as jcg
  >>> from jax_comm_gemm.fp8 import Fp8Recipe
  >>> fp8_collectives(jcg.CommGemmConfig(backend="ring", fp8=Fp8Recipe()), AG, None,
  ...                 None, False, "tp", False, jcg.runtime.REGISTRY.plan())
  ('ring', "backend='ring'")
  """
  backend = _fp8_backend(config, plan)
  if backend in ("xla", "ring"):
    return backend, f"backend={backend!r}"
  fused = bound(fused_backend(config), plan)
  if backend == "cublasmp":
    why = cublasmp_refusal(fused, workspace(lax.axis_size(axis_name), plan),
                           "backend='cublasmp' (FP8)")
    if why:
      raise RuntimeError(why)
    return fused, "backend='cublasmp'"
  p = problem(op, x, w, transpose_w, axis_name, gathered=gathered, fp8=config.fp8.key)
  name, why = choose(p, "xla", plan)
  runs = runnable(name, p, plan)
  if not runs.ok:  # forced by the environment where it cannot run
    return "xla", f"{why}; {name} cannot run it ({runs.reason}): XLA's collectives"
  return fp8_collectives_of(name, fused), why
