"""Which path a layer takes and why, which implementation each op of a step
runs under ``backend="auto"`` (:func:`op_paths`), and how many all-gathers a training step
should hold, for reports (the example) and tests, to set beside what
:func:`jax_comm_gemm.diagnostics.hlo.compiled_collectives` counts. Both come
from the functions that decide at trace time (``backends.routes``)."""

from __future__ import annotations

import dataclasses

import warnings

from jax_comm_gemm.backends import (AutoBackend, CublasMpBackend, RingBackend, choose_backend,
                                    pallas)
from jax_comm_gemm.backends.routes import (AG, Problem, bound, choose, fp8_route, fused_backend,
                                           gathered_route, workspace)
from jax_comm_gemm.backends.tuning import problems_of
from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.runtime import plan as plan_lib
from jax_comm_gemm.runtime.capability import (CUBLASMP_ALGORITHMS, PLAIN_WORKSPACE,
                                              symmetric_memory)
from jax_comm_gemm.runtime.registry import current_plan

FUSED_WITH_REUSE = "fused with reuse"
FUSED_WITH_ALL_GATHER = "fused with all_gather"
XLA_FALLBACK = "xla fallback"
RING = "ring"
PALLAS_KERNEL = "pallas kernel"
FP8_ON_XLA = "fp8 on xla"
FP8_ON_RING = "fp8 on ring"


def single_device_reason(axis_name: str) -> str:
  """Why nothing is fused or tuned on an axis of size 1."""
  return (f"axis {axis_name!r} has size 1: a group of one has nothing to communicate, "
          "so each layer is a plain GEMM on XLA")


@dataclasses.dataclass(frozen=True)
class LayerPath:
  """How a layer runs (one of the names above) and why.

  >>> print(LayerPath(XLA_FALLBACK, "backend='xla' was requested"))
  xla fallback (backend='xla' was requested)
  """
  path: str
  reason: str

  def __str__(self) -> str:
    return f"{self.path} ({self.reason})"


def layer_path(config: CommGemmConfig, mesh, axis_name: str, dtype, *,
               reduce_scatter_layer: bool = False,
               keep_gathered_input: bool = False,
               path_reason: str | None = None) -> LayerPath:
  """How a layer's AllGather+GEMM runs on `axis_name` of `mesh`, and where its
  weight gradient gets the gathered operand: a row-parallel layer
  (`reduce_scatter_layer`) can reuse the grad_output its backward gathers, a
  column-parallel one its forward's input only with `keep_gathered_input`.
  `path_reason` (``module.path_reason()``) comes first.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
  >>> layer_path(jcg.CommGemmConfig(backend="xla"), mesh, "tp", "bfloat16").path
  'xla fallback'
  """
  if path_reason is not None:
    return LayerPath(XLA_FALLBACK, path_reason)
  size = int(mesh.shape[axis_name])
  # A user's entry (a report's question): the plan in force, read once, so that
  # every answer below is under the same plan.
  plan = current_plan()
  fp8 = fp8_route(config, plan)
  if fp8.fp8:  # FP8 GEMMs whatever the axis; on XLA's collectives, the ring or fused
    if size == 1:
      return LayerPath(FP8_ON_XLA, f"FP8 GEMMs; {single_device_reason(axis_name)}")
    if fp8.backend == "cublasmp":  # the fused FP8 ops: reuse as in bf16, FP8 bytes
      if not (reduce_scatter_layer or keep_gathered_input):
        return LayerPath(FUSED_WITH_ALL_GATHER, f"{fp8.reason}; a column-parallel layer "
                         "gathers its input again in the backward pass unless "
                         "keep_gathered_input=True")
      gathered = config.fp8.backward_dtype if reduce_scatter_layer else config.fp8.forward_dtype
      fused = bound(fused_backend(config), plan)
      route = gathered_route(fused, config.reuse_gathered, size, gathered, transpose_w=True)
      return LayerPath(FUSED_WITH_REUSE if route.reuse else FUSED_WITH_ALL_GATHER,
                       f"{fp8.reason}; {route.reason}{_mode(fused, size, plan)}")
    # "auto" runs each shape as measured; the counts below are XLA's, the
    # default where nothing was measured (the compiled step's show which).
    return LayerPath(FP8_ON_RING if fp8.backend == "ring" else FP8_ON_XLA, fp8.reason)
  choice = choose_backend(config, axis_name, mesh, plan=plan)
  if size == 1:  # whatever the backend: each layer is a plain GEMM
    return LayerPath(XLA_FALLBACK, single_device_reason(axis_name))
  if isinstance(choice.backend, pallas.PallasBackend):
    # Its weight gradients gather again (the kernel hands out no gathered
    # operand), as XLA's do: the counts are the fallback's either way.
    verdict = pallas.supports_layer(dtype, reduce_scatter_layer,
                                    keep_gathered_input or reduce_scatter_layer, size)
    if verdict.ok:
      return LayerPath(PALLAS_KERNEL, "jax's Mosaic GPU kernel runs the AllGather+GEMM "
                                      "where its tiles divide the shape, else XLA's ops")
    return LayerPath(XLA_FALLBACK, f"{choice.reason}; the Pallas kernel cannot run it: "
                                   f"{verdict.reason}")
  if isinstance(choice.backend, RingBackend):  # XLA's GEMMs on a ring of ppermutes
    return LayerPath(RING, choice.reason)
  if not isinstance(choice.backend, (CublasMpBackend, AutoBackend)):
    return LayerPath(XLA_FALLBACK, choice.reason)
  # With "auto" each AllGather+GEMM runs fused or on XLA as measured for its
  # shape; the path below is the fused one, which the measured shapes take
  # where the fused op is faster (the compiled step's counts show which).
  per_shape, mode = "", ""
  if isinstance(choice.backend, AutoBackend):
    found = workspace(size, plan)
    per_shape = ("backend='auto', where autotune finds the fused op faster: "
                 if symmetric_memory(found) else
                 f"backend='auto' ({found.reason}), where autotune finds the fused op "
                 "faster: " if found.ok else
                 f"backend='auto' ({found.reason}), where autotune finds one of the "
                 "project's own algorithms faster: ")
  else:
    mode = _mode(choice.backend, size, plan)
  if not (reduce_scatter_layer or keep_gathered_input):
    return LayerPath(FUSED_WITH_ALL_GATHER,
                     per_shape + "a column-parallel layer gathers its input again in the "
                     "backward pass unless keep_gathered_input=True" + mode)
  route = gathered_route(choice.backend, config.reuse_gathered, size, dtype,
                         transpose_w=reduce_scatter_layer)
  return LayerPath(FUSED_WITH_REUSE if route.reuse else FUSED_WITH_ALL_GATHER,
                   per_shape + route.reason + mode)


def _mode(fused, axis_size: int, plan) -> str:
  """Where cuBLASMp's algorithms of `fused` run on a plain workspace (under
  `plan`), a clause that says so (connect's verdict names the mode), else ""."""
  found = workspace(axis_size, plan)
  uses_cublasmp = any(getattr(fused, field, None) in CUBLASMP_ALGORITHMS
                      for field in ("all_gather_algorithm", "reduce_scatter"))
  if not uses_cublasmp or symmetric_memory(found) or not found.ok:
    return ""
  return f"; plain workspace ({PLAIN_WORKSPACE})"


@dataclasses.dataclass(frozen=True)
class OpPath:
  """The implementation ("xla", "ring", "cublasmp_split_p2p", ...) that runs
  one op of a step, and why (:func:`op_paths`)."""
  problem: Problem
  implementation: str
  why: str

  @property
  def role(self) -> str:
    """Which pass of which layer the op is, for the library's layers (their
    kernels untransposed): a column-parallel layer's forward is an
    AllGather+GEMM and its dgrad a GEMM+ReduceScatter of the transposed
    kernel, a row-parallel layer the other way round. An FP8 op is chosen
    once, for its forward and its backward.

    >>> from jax_comm_gemm.backends.routes import RS
    >>> OpPath(Problem(RS, 8, 4, 16, "bfloat16", True, 2), "xla", "").role
    'column-parallel backward'
    """
    column = (self.problem.op == AG) != self.problem.transpose_w
    which = ("forward and backward" if self.problem.fp8 else
             "backward" if self.problem.transpose_w else "forward")
    return f"{'column' if column else 'row'}-parallel {which}"


def op_paths(config: CommGemmConfig, plan, step, *args) -> list[OpPath]:
  """Each op of `step(*args)` that ``backend="auto"`` (or FP8 on "auto") chooses
  an implementation for, in order, with the implementation and why under
  `plan`: the choices a program of `step` traced under `plan` was compiled
  with (for ``autotune_step``'s step, its ``routes`` and ``step``). Traces
  `step` once more (``jax.eval_shape``), compiles nothing. Empty where no op
  is chosen per problem (a backend other than "auto", or cuBLASMp unavailable).

  >>> import jax.numpy as jnp, jax_comm_gemm as jcg
  >>> op_paths(jcg.CommGemmConfig(), jcg.runtime.REGISTRY.plan(), lambda x: x + 1, jnp.zeros(2))
  []
  """
  with plan_lib.use(plan):
    problems = problems_of(step, *args)
  auto = config.backend if isinstance(config.backend, AutoBackend) else AutoBackend(fused_backend(config))
  found = []
  with warnings.catch_warnings():  # the step's trace said so already: each not measured
    warnings.simplefilter("ignore", RuntimeWarning)
    for p in problems:
      found.append(OpPath(p, *choose(p, "xla" if p.fp8 else auto.default(p.op), plan)))
  return found


@dataclasses.dataclass(frozen=True)
class ExpectedCounts:
  """Collectives in one forward + backward, as
  :func:`jax_comm_gemm.diagnostics.hlo.count_collectives` counts them:
  standalone ``all-gather`` ops (over groups of more than one device) and
  fused AllGather+GEMM custom calls."""
  standalone_all_gathers: int
  fused_all_gather_matmuls: int


def expected_all_gathers(config: CommGemmConfig, mesh, axis_name: str, dtype, *,
                         keep_gathered_input: bool = False) -> ExpectedCounts:
  """The all-gathers of one SP-MLP block's forward + backward: none on an axis of
  size 1; with the fused ops two fused (fc1's forward, fc2's dgrad) and a
  standalone one per weight gradient that does not reuse its operand (2, 1 with
  fc2's reuse, 0 when fc1 keeps its input too); on XLA's collectives 2 (XLA's
  CSE merges fc1's backward gather with its forward's); on the ring, bf16 or
  FP8, 1 (fc1's backward; 0 with `keep_gathered_input`)."""
  if int(mesh.shape[axis_name]) == 1:
    return ExpectedCounts(0, 0)
  fc1 = layer_path(config, mesh, axis_name, dtype, keep_gathered_input=keep_gathered_input)
  fc2 = layer_path(config, mesh, axis_name, dtype, reduce_scatter_layer=True)
  if fc2.path in (XLA_FALLBACK, FP8_ON_XLA):
    return ExpectedCounts(2, 0)
  if fc2.path in (RING, FP8_ON_RING):  # the rings gather by ppermute; fc1's backward again
    return ExpectedCounts(int(not keep_gathered_input), 0)
  return ExpectedCounts(int(fc1.path != FUSED_WITH_REUSE) + int(fc2.path != FUSED_WITH_REUSE),
                        2)


def expected_block_all_gathers(config: CommGemmConfig, mesh, axis_name: str, dtype, *,
                               keep_gathered_input: bool = False,
                               remat: bool = False) -> ExpectedCounts:
  """The all-gathers of one transformer block's forward + backward: twice the
  SP-MLP block's; with `remat` QKV's and fc1's forward gathers run again (2
  more, fused where the forward's are; none on the bf16 ring, whose are ppermutes)."""
  mlp = expected_all_gathers(config, mesh, axis_name, dtype,
                             keep_gathered_input=keep_gathered_input)
  standalone, fused = 2 * mlp.standalone_all_gathers, 2 * mlp.fused_all_gather_matmuls
  ring = layer_path(config, mesh, axis_name, dtype).path == RING
  if remat and int(mesh.shape[axis_name]) > 1 and not ring:
    standalone, fused = (standalone, fused + 2) if fused else (standalone + 2, fused)
  return ExpectedCounts(standalone, fused)
