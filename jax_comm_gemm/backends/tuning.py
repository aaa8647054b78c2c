"""``autotune``: measure which implementation is fastest for each problem that
``backend="auto"`` met, once, and make every rank take the same choice.

Collective, like ``connect``: every process calls it with the problems to
measure (``problems_of(step, *args)`` lists a step's), before tracing the
program for real: a program traced before keeps its routes. Process 0
leads: it says which problems to measure (those not in its disk cache), every
process times every candidate on its devices, interleaved (A B C A B C ...,
medians, so that clock changes under the power cap hit all alike), process 0
takes the slowest process's time per candidate, picks the fastest candidate
and publishes the choices through the key-value store. The choices go into
the routing plan (runtime/plan.py) and the disk cache, keyed by GPU model and
versions. A candidate
that fails to build or run, or whose result differs from XLA's on the same
inputs, in any process, is left out in every process, which all learn of it
before the next candidate runs (timing.py's module docstring).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_comm_gemm.runtime.kv as kv
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.backends.auto import (AG, CANDIDATES, FP8_CANDIDATES, IMPLEMENTATIONS, Problem,
                                         candidates, fp8_collectives_of, implementation, runnable)
from jax_comm_gemm.backends.primitives import CublasMpBackend
# Re-exported: autotune's measuring steps live in timing.py.
from jax_comm_gemm.backends.timing import (WARMUP_ROUNDS, UnionOfFailures, build,  # noqa: F401
                                           decide, fastest, time_candidates, with_failures)
from jax_comm_gemm.backends.verify import against_xla
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from jax_comm_gemm.runtime import comm_id, settings
from jax_comm_gemm.runtime.registry import REGISTRY, current_plan

log = logging.getLogger("jax_comm_gemm.autotune")


def _random(mesh, shape, spec, dtype, seed, scale=1.0):
  sharding = NamedSharding(mesh, spec)
  make = jax.jit(lambda key: (scale * jax.random.normal(key, shape, "float32")).astype(dtype),
                 out_shardings=sharding)
  return make(jax.random.key(seed))


def iterations(p: Problem, seconds: float) -> int:
  """Calls per timed batch, about `seconds / 10` of work. It must be the same
  in every process (a collective program called a different number of times
  would hang), so it comes from the problem's size, never from a timing:
  roughly 400 TFLOP/s plus 30 us a call."""
  estimate = p.flop() / 4e14 + 3e-5
  return max(1, min(200, int(seconds / 10 / estimate)))


def _runnables(mesh, axis_name: str, p: Problem, seconds: float) -> dict:
  """A compiled program per candidate of `p` on random data, as
  time_candidates takes them: ``(call, iterations)``, the error that building
  it raised, or None where the candidate cannot run `p`."""
  size = p.axis_size
  if p.op == AG:
    x = _random(mesh, (p.rows * size, p.k), P(axis_name), p.dtype, 1)
    w_spec = P(axis_name) if p.transpose_w else P(None, axis_name)
    w_shape = (p.m * size, p.k) if p.transpose_w else (p.k, p.m * size)
    y_spec = P(None, axis_name)
    specs = dict(in_specs=(P(axis_name), w_spec),
                 out_specs=(y_spec, P(axis_name)) if p.gathered else y_spec)
  else:
    x = _random(mesh, (p.rows, p.k * size), P(None, axis_name), p.dtype, 1)
    w_spec = P(None, axis_name) if p.transpose_w else P(axis_name)
    w_shape = (p.m, p.k * size) if p.transpose_w else (p.k * size, p.m)
    specs = dict(in_specs=(P(None, axis_name), w_spec), out_specs=P(axis_name))
  # A layer's magnitudes (weights ~ k^-1/2, as initialisers give): a GEMM's
  # power, so its clock under the cap, depends on the data it multiplies.
  w = _random(mesh, w_shape, w_spec, p.dtype, 2, scale=p.k ** -0.5)
  # Every candidate has an entry, in the same order in every process: one
  # that cannot run here, or failed to compile, counts as failed in
  # time_candidates' first agreement, before any candidate runs (a program
  # run by some processes alone would hang).
  runs = {}
  for name in candidates(p):
    if not runnable(name, p).ok:
      runs[name] = None
      continue
    backend = implementation(name, CublasMpBackend())

    def local(x, w, backend=backend, name=name):
      if p.fp8:  # the FP8 op, its fused steps on `name`'s collectives
        recipe = Fp8Recipe.from_key(p.fp8)
        collectives = fp8_collectives_of(name, CublasMpBackend())
        if p.op == AG:
          return fp8_all_gather_matmul(x, w, axis_name, recipe=recipe,
                                       transpose_w=p.transpose_w, return_gathered=p.gathered,
                                       collectives=collectives)
        return fp8_matmul_reduce_scatter(x, w, axis_name, recipe=recipe,
                                         transpose_w=p.transpose_w, collectives=collectives)
      if p.op == AG:
        return backend.all_gather_matmul(x, w, axis_name, transpose_w=p.transpose_w,
                                         return_gathered=p.gathered)
      return backend.matmul_reduce_scatter(x, w, axis_name, transpose_w=p.transpose_w)

    runs[name] = build(lambda local=local: jax.jit(jax.shard_map(local, mesh=mesh, **specs))
                       .lower(x, w).compile(),
                       lambda program: program(x, w), iterations(p, seconds))
  return runs


# Raised when the timing method or a candidate's own algorithm changes, so
# that choices cached on disk before are measured again (2: rounds alternate
# in order; 3: the GEMM+ReduceScatter's chunks follow each block's work).
METHOD = 3


def signature() -> str:
  """The disk cache's section for this GPU model, these versions and candidates."""
  native = REGISTRY.native()
  return (f"{jax.devices()[0].device_kind}|timing {METHOD}|jax {jax.__version__}|cuBLASMp "
          f"{native.cublasmp_version()}|NCCL {native.nccl_version()}|"
          # New candidates make old choices stale.
          f"{';'.join(','.join(names) for names in (*CANDIDATES.values(), *FP8_CANDIDATES.values()))}")


def load_cache(path: str) -> dict:
  """The disk cache ({signature: {key: [choice, why]}}); empty if unreadable."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def save_cache(path: str, cache: dict) -> None:
  """Writes the whole cache atomically (a reader never sees half a file)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  temporary = f"{path}.{os.getpid()}.tmp"
  try:
    with open(temporary, "w") as f:
      json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(temporary, path)
  except BaseException:  # a failed write leaves nothing behind
    if os.path.exists(temporary):
      os.remove(temporary)
    raise


def tunable(mesh, axis_name: str, plan) -> str | None:
  """Why nothing can be tuned on `axis_name` under `plan`, or None.
  Raises where the axis could be tuned but is not connected."""
  if int(mesh.shape[axis_name]) == 1:
    return f"axis {axis_name!r} has size 1: nothing to communicate"
  if plan.settings.autotune != "on":
    return f"measuring is off ({settings.AUTOTUNE}={plan.settings.autotune})"
  if not plan.cublasmp.ok:
    return f"cuBLASMp cannot run here: {plan.cublasmp.reason}"
  if plan.comm_id(mesh, axis_name) is None:
    raise RuntimeError(f"autotune: mesh axis {axis_name!r} is not connected; call "
                       f"jax_comm_gemm.connect(mesh, {axis_name!r}) first")
  return None


_TAGS = itertools.count(1)  # makes each problems_of trace's plan a new one


def problems_of(step, *args) -> list[Problem]:
  """The problems `step(*args)` meets that ``backend="auto"`` chooses for, in
  order: `step` is traced (``jax.eval_shape``) under a copy of the plan in
  force that no trace saw before, which lists them, so the library's
  trace-time code runs even where `step` was traced already, and programs
  traced outside it stay as they are.

  >>> import jax.numpy as jnp
  >>> problems_of(lambda x: x + 1, jnp.zeros(2))  # no collective matmul
  []
  """
  found: list = []
  with plan_lib.use(dataclasses.replace(current_plan(), tag=next(_TAGS), problems=found)):
    jax.eval_shape(step, *args)
  return list(dict.fromkeys(found))


def autotune(mesh, axis_name: str = "tp", problems=(), *,
             seconds_per_problem: float = 1.0) -> dict[Problem, tuple[str, str]]:
  """Measures `problems` (``problems_of`` lists a step's) on `axis_name` and
  publishes a routing plan with the choices (collective: every process calls
  it; see the module docstring). Programs traced after it take the choices;
  those traced before keep their routes (tracing warned of that). Returns
  the choices made; does nothing where nothing can be tuned (no cuBLASMp,
  ``JAX_COMM_GEMM_AUTOTUNE`` other than "on", an axis of size 1).

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> autotune(mesh, "tp")  # on a CPU: nothing to tune
  {}
  """
  plan = current_plan()
  if tunable(mesh, axis_name, plan) is not None:
    return {}
  size = int(mesh.shape[axis_name])
  wanted = [q for q in problems if q.axis_size == size]
  choices = measure(mesh, axis_name, wanted, plan, seconds_per_problem=seconds_per_problem)
  REGISTRY.record_decisions(choices)
  return choices


def measure(mesh, axis_name: str, problems, plan, *,
            seconds_per_problem: float = 1.0) -> dict[Problem, tuple[str, str]]:
  """The choice for each of `problems` (process 0's list counts), from the
  disk cache or measured; collective, publishes nothing."""
  ident = comm_id(mesh, axis_name)
  attempt = REGISTRY.next_attempt(("autotune", ident))
  timeout = plan.settings.connect_timeout_s
  path = plan.settings.autotune_cache
  section = signature()

  def split():  # process 0's view rules: which problems, and which the cache answers
    known = load_cache(path).get(section, {}) if path else {}
    found = {"measure": [], "cached": []}
    for q in dict.fromkeys(problems):
      entry = known.get(q.text())
      found["cached" if entry else "measure"].append([vars(q), entry])
    return found

  work = kv.from_leader(ident, attempt, "autotune", "plan", make=split, timeout_s=timeout)
  choices = {Problem(**q): tuple(entry) for q, entry in work["cached"]}
  for index, (q, _) in enumerate(work["measure"]):
    p = Problem(**q)
    log.info("autotune: measuring %s (%d of %d)", p.text(), index + 1, len(work["measure"]))
    runs = _runnables(mesh, axis_name, p, seconds_per_problem)
    agree = UnionOfFailures(ident, attempt, "autotune", index, "failed", timeout=timeout)
    mine = time_candidates(runs, rounds=10, warmup_rounds=WARMUP_ROUNDS, agree=agree,
                           verify=against_xla())

    def decided(times, failures=agree.failed):
      chosen, why = decide({name: [t[name] for t in times] for name in times[0]})
      return [chosen, with_failures(why, failures)]

    choice = kv.leader_decides(ident, attempt, "autotune", index, value=mine,
                               timeout_s=timeout, decide=decided)
    choices[p] = tuple(choice)
  measured = {Problem(**q).text(): list(choices[Problem(**q)]) for q, _ in work["measure"]}
  remember(path, section, measured)
  return choices


def remember(path: str, section: str, entries: dict) -> None:
  """Adds `entries` to `section` of the disk cache at `path` (process 0 only;
  nothing where `path` is "" or there is nothing to add)."""
  if jax.process_index() == 0 and path and entries:
    cache = load_cache(path)
    cache.setdefault(section, {}).update(entries)
    save_cache(path, cache)
