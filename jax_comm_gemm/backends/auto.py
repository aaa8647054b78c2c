"""``backend="auto"``: per problem, the implementation that measured fastest.

A problem is one op at one shape: (op, local rows, k, local m, dtype,
transpose, group size). Its implementation comes from, in order:

1. ``JAX_COMM_GEMM_AUTOTUNE`` naming an implementation (forced);
2. the choice ``autotune`` measured (once per process, cached on disk, the
   same on every rank: see tuning.py), read from the routing plan in force;
3. a rule of thumb where nothing was measured (or measuring is off): XLA for
   per-GPU GEMMs under ``FUSED_FROM_FLOP`` (there the fused op's fixed cost
   outweighs the hidden all-gather), else the configured algorithm. With
   measuring on, a warning says that the program keeps this route when
   ``autotune`` measures the problem later.

Where connect found that cuBLASMp cannot get its workspace on groups of the
problem's size, none of the three takes cuBLASMp's algorithms or jax's Pallas
kernel (both need NCCL symmetric memory): XLA runs instead, and autotune does
not measure them. Every step reads the plan (runtime/plan.py) at trace time,
the same in every process, and writes nothing (``tuning.problems_of`` lists
the problems of a trace in a list its own plan carries). Why per problem, and the measurements behind the
rule of thumb: docs/design.md#backendauto-and-autotuning.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
from jax import lax

import jax_comm_gemm.backends.pallas as pallas
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.backends.xla import PLAIN_BACKENDS
from jax_comm_gemm.fp8.recipe import Fp8Recipe
from jax_comm_gemm.fp8.steps import why_not_fused
from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.capability import Capability, WorkspaceKey
from jax_comm_gemm.runtime.constants import OWN_ALGORITHMS
from jax_comm_gemm.runtime.registry import current_plan

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
# What autotune measures, per op. "cublasmp_<algorithm>" runs cuBLASMp's fused
# op; the project's own algorithms (OWN_ALGORITHMS) run by their names;
# "pallas_mgpu" is jax's Mosaic GPU kernel (pallas.py), measured only where it
# can run (runnable()). XLA comes first: autotune checks the others' results
# against its (verify.against_xla).
CANDIDATES = {
    AG: ("xla", "ring", "cublasmp_default", "cublasmp_split_p2p", "pipelined_ce", pallas.NAME),
    RS: ("xla", "ring", "cublasmp_default", "cublasmp_split_p2p", "pipelined_ce"),
}
# What an FP8 problem may run on: its fused steps on XLA's collectives, the
# ring (jax_comm_gemm/ring.py) or the extension's fused FP8 ops, which
# take one scale per tensor and dims of multiples of 16 (runnable()). jax's
# Pallas kernel has no FP8 (docs/fp8.md).
FP8_CANDIDATES = {op: tuple(n for n in names if n != pallas.NAME)
                  for op, names in CANDIDATES.items()}
# Every name JAX_COMM_GEMM_AUTOTUNE may force (settings.py checks it; a test
# holds the two equal).
IMPLEMENTATIONS = settings.IMPLEMENTATIONS
# 2 * rows * k * m per GPU: 4096^3 at TP 2 is 0.69e11 (XLA won), 8192x4096x4096
# and 2048x8192x8192 are 1.37e11 (fused won): docs/performance.md.
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
  # AllGather+GEMM: the gathered operand is an output too. Layers ask for it
  # where the weight gradient reuses it, and it costs the implementations
  # unlike amounts (free for XLA, a copy out of the workspace for cuBLASMp,
  # an assembly for the ring), so such calls are their own problem, measured
  # as they are made.
  gathered: bool = False
  # The Fp8Recipe's key (Fp8Recipe.key) where the op runs in FP8, else "":
  # FP8 problems have their own candidates and choices.
  fp8: str = ""

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


def workspace(axis_size: int, plan=None) -> Capability:
  """Whether cuBLASMp got its workspace on groups of `axis_size` (connect's
  probe, in `plan`, default: the plan in force)."""
  return (current_plan() if plan is None else plan).verdict(WorkspaceKey(int(axis_size)))


def _refusal(name: str, axis_size: int, plan) -> str | None:
  """Why `name` cannot run at all on groups of `axis_size`, or None: cuBLASMp's
  algorithms need its workspace, and jax's Pallas kernel NCCL symmetric
  windows, which the same probe found missing (the kernel fails there with
  "ncclGetPeerDevicePointer: window argument is NULL")."""
  if not (name.startswith("cublasmp_") or name == pallas.NAME):
    return None
  verdict = workspace(axis_size, plan)
  if verdict.ok:
    return None
  return (verdict.reason if name != pallas.NAME else
          f"jax's Pallas kernel needs NCCL symmetric memory too: {verdict.reason}")


def runnable(name: str, p: Problem, plan=None) -> Capability:
  """Whether implementation `name` can run `p` as itself. The Pallas kernel
  has limits (where it cannot, its backend runs XLA's ops), and so do the
  fused FP8 ops (where they cannot, FP8 runs on XLA's collectives); neither
  it nor cuBLASMp's algorithms run where cuBLASMp was refused its workspace."""
  refused = _refusal(name, p.axis_size, current_plan() if plan is None else plan)
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


def choose(p: Problem, default: str, plan=None) -> tuple[str, str]:
  """(implementation, why) for `p` under `plan` (default: the plan in
  force); `default` is the configured fused one."""
  plan = current_plan() if plan is None else plan
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
  why = "measuring is off" if mode == "off" else "not measured yet (jax_comm_gemm.autotune)"
  # Only where measuring could choose otherwise: more than one candidate runs.
  if mode == "on" and plan.problems is None and p.axis_size > 1 and \
      sum(runnable(c, p, plan).ok for c in candidates(p)) > 1:
    warnings.warn(f"jax_comm_gemm: {p.text()} is not measured: the rule of thumb routes it, "
                  "and a program traced now keeps that route when autotune measures it "
                  "later; autotune before tracing (jax_comm_gemm.autotune(mesh, axis, "
                  "jax_comm_gemm.problems_of(step, *args))), or run the step that "
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

  >>> AutoBackend(CublasMpBackend(all_gather_algorithm="pipelined_ce")).fused.all_gather_algorithm
  'pipelined_ce'
  """

  fused: CublasMpBackend = CublasMpBackend()

  name = "auto"

  def chosen(self, op: str, x, w, transpose_w, axis_name, gathered=False) -> Backend:
    """The backend that runs op `op` (AG or RS) on these operands (arrays or
    their shapes), `gathered`: an AllGather+GEMM that hands out its operand."""
    configured = (self.fused.all_gather_algorithm if op == AG else self.fused.reduce_scatter)
    default = (configured if configured in PLAIN_BACKENDS or configured in OWN_ALGORITHMS
               else f"cublasmp_{configured}")
    name, _ = choose(problem(op, x, w, transpose_w, axis_name, gathered), default)
    return implementation(name, self.fused)

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
    plan = current_plan()
    for name in CANDIDATES[AG]:
      if name not in PLAIN_BACKENDS and _refusal(name, axis_size, plan) is None:
        verdict = implementation(name, self.fused).gathered_reuse(axis_size, dtype,
                                                                  transpose_w)
        if not verdict.ok:
          return verdict
    return Capability(True, "every implementation auto may choose hands it out")
