"""``autotune`` (each op alone) and ``autotune_step`` (the whole step under each
plan): how candidates are built, checked against XLA, timed and chosen, and
how every process takes the same choice. Longer than 300 lines: both tuners share every step but the last.

Both are collective. Process 0 says what to measure (what its disk cache does
not answer); every process times every candidate, interleaved, after untimed
rounds of load; process 0 takes the slowest process's time per candidate,
picks the fastest and publishes it through the key-value store. A candidate
that fails anywhere (to build, to run, to match XLA's result) is dropped by
every process before the next program runs (:class:`UnionOfFailures`).
``autotune_step`` keeps a plan only where it leads the all-XLA step by more
than ``KEEP_MARGIN``. Why: docs/design.md#backendauto-and-autotuning and
#whole-step-tuning-autotune_step."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from types import MappingProxyType
from typing import Any, Callable

import jax
from filelock import FileLock
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_comm_gemm.runtime.kv as kv
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.backends.routes import (AG, CANDIDATES, FP8_CANDIDATES, IMPLEMENTATIONS,
                                           Problem, candidates, fp8_collectives_of,
                                           implementation, runnable, workspace)
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from jax_comm_gemm.runtime import comm_id, settings
from jax_comm_gemm.runtime.capability import symmetric_memory
from jax_comm_gemm.runtime.plan import Plan
from jax_comm_gemm.runtime.registry import REGISTRY, current_plan

log = logging.getLogger("jax_comm_gemm.autotune")

# --- timing and choosing (both tuners) ----------------------------------------------

# The failure of a candidate that is no program here (None in `runs`).
CANNOT_RUN = "cannot run here"


def fastest(times: dict[str, list[float]]) -> tuple[str, dict[str, float]]:
  """(the fastest, each one's time) where each one's time is its slowest
  process's (a collective step runs at its slowest rank's pace); ties go to
  the first name, alike in every process."""
  worst = {name: max(per_process) for name, per_process in times.items()}
  return min(worst, key=lambda name: (worst[name], name)), worst


def decide(times: dict[str, list[float]]) -> tuple[str, str]:
  """(fastest candidate, why) from each candidate's seconds in every process
  (``inf``: failed); the slowest process counts.

  >>> decide({"xla": [1e-3, 2e-3], "ring": [1.5e-3, 1.5e-3]})
  ('ring', 'measured: ring 1.500 ms, xla 2.000 ms')
  """
  chosen, worst = fastest(times)
  if not math.isfinite(worst[chosen]):
    return "xla", "every candidate failed to run; XLA is the fallback"
  return chosen, f"measured: {_listing(worst)}"


def _listing(worst: dict[str, float], label=str) -> str:
  """Each candidate's time (or "failed"), fastest first."""
  return ", ".join(f"{label(name)} {t * 1e3:.3f} ms" if math.isfinite(t) else
                   f"{label(name)} failed" for name, t in sorted(worst.items(),
                                                                key=lambda i: i[1]))


def with_failures(why: str, failures: dict[str, str]) -> str:
  """`why`, and which candidates failed where and why (UnionOfFailures.failed).

  >>> with_failures("measured: xla 1.000 ms, ring failed", {"ring": "process 1: no memory"})
  'measured: xla 1.000 ms, ring failed; failed: ring (process 1: no memory)'
  """
  if not failures:
    return why
  return f"{why}; failed: " + ", ".join(f"{name} ({message})"
                                        for name, message in failures.items())


def message(error: BaseException) -> str:
  """An exception's first line (the library's own words), at most 300 characters."""
  lines = [line for line in str(error).splitlines() if line.strip()]
  return (lines[0] if lines else type(error).__name__)[:300]


def build(compile_, call, iterations: int):
  """A candidate as time_candidates takes it: ``(lambda: call(program),
  iterations)`` with ``program = compile_()``, or the error compiling raised."""
  try:
    program = compile_()
  except Exception as e:  # noqa: BLE001  (a candidate this machine cannot build)
    return message(e)
  return (lambda: call(program), iterations)


def time_candidates(runs: dict, *, rounds: int, warmup_rounds: int = 0,
                    timer=time.perf_counter, wait=jax.block_until_ready,
                    agree=lambda failed: failed,
                    verify=lambda name, out: None, reference: str | None = None,
                    about: str = "") -> dict[str, float]:
  """Median seconds per call of each candidate of `runs`, over `rounds`
  interleaved rounds (a b c, then c b a) after `warmup_rounds` alike untimed.
  A value of `runs` is ``(call, iterations)`` (a batch enqueues `iterations`
  calls and waits once: the throughput of back-to-back calls), a string (the
  error that building it raised), or None (it cannot run here). `verify(name,
  out)` says what is wrong with a warm-up result, or None. `agree` turns this
  process's failures of a step into every process's (:class:`UnionOfFailures`),
  after building, each warm-up and each batch. A failed candidate gets ``inf``;
  where `reference` (the candidate `verify` checks the others against) fails,
  every process raises a RuntimeError naming `about` (what is measured) and why.

  >>> times = time_candidates({"a": (lambda: 1, 2)}, rounds=3, wait=lambda out: None)
  >>> sorted(times)
  ['a']
  """
  samples = {name: [] for name in runs}
  # Building: every process's programs exist, or their errors, before any runs.
  built = {name: CANNOT_RUN if run is None else run for name, run in runs.items()
           if not isinstance(run, tuple)}
  for name, error in built.items():
    if error != CANNOT_RUN:
      log.warning("autotune: candidate %s failed to build: %s", name, error)
  failed = dict(_agreed(agree, built, {}))

  def attempt(name, step):
    """Runs `step()` (what is wrong, or None) for candidate `name`, then agrees."""
    try:
      wrong = step()
    except Exception as e:  # noqa: BLE001  (a candidate this machine cannot run)
      wrong = message(e)
      log.warning("autotune: candidate %s failed: %s", name, wrong)
    failed.update(_agreed(agree, {name: wrong} if wrong else {}, failed))

  def warm_up(name, call):
    out = call()
    wait(out)
    wrong = verify(name, out)
    if wrong is not None:
      log.warning("autotune: candidate %s gave a wrong result: %s", name, wrong)
      return f"wrong result: {wrong}"
    return None

  def timed(name, call, iterations, index):
    start = timer()
    out = None
    for _ in range(iterations):
      out = call()
    wait(out)
    if index >= warmup_rounds:
      samples[name].append((timer() - start) / iterations)

  for name, run in runs.items():  # warm up (compiled already) and check, untimed
    if name not in failed:
      log.debug("autotune: warming up %s", name)
      attempt(name, lambda name=name, call=run[0]: warm_up(name, call))
    if name == reference and name in failed:  # agreed: every process raises here
      raise RuntimeError(
          f"jax_comm_gemm autotune: {about}: XLA's run, the reference every candidate is "
          f"checked against, failed, so nothing can be checked or chosen; failed: "
          + ", ".join(f"{n} ({why})" for n, why in failed.items()))
  for index in range(warmup_rounds + rounds):
    order = list(runs.items()) if index % 2 == 0 else list(runs.items())[::-1]
    for name, run in order:
      if name not in failed:
        log.debug("autotune: timing %s", name)
        attempt(name, lambda name=name, run=run: timed(name, *run, index))
  return {name: (statistics.median(s) if s and name not in failed else math.inf)
          for name, s in samples.items()}


def _agreed(agree, mine: dict[str, str], known: dict[str, str]) -> dict[str, str]:
  """`agree(mine)`, each failure that another process saw logged here."""
  every = agree(mine)
  for name, why in every.items():
    if name not in mine and name not in known:
      log.warning("autotune: candidate %s failed elsewhere (%s); skipped here too", name, why)
  return every


# Untimed rounds of load before the timed ones, so that those run at steady-state clocks.
WARMUP_ROUNDS = 3


def union(per_process: list[dict[str, str]]) -> dict[str, str]:
  """Every process's failures ({name: message}, in process order) as one, each
  with the processes that saw it where there are several.

  >>> union([{"ring": "no memory"}, {"ring": "no memory", "xla": "timeout"}])
  {'ring': 'processes 0, 1: no memory', 'xla': 'process 1: timeout'}
  >>> union([{"ring": "no memory"}])
  {'ring': 'no memory'}
  """
  if len(per_process) == 1:
    return dict(per_process[0])
  seen: dict[str, dict[str, list[int]]] = {}
  for process, failures in enumerate(per_process):
    for name, why in failures.items():
      seen.setdefault(name, {}).setdefault(why, []).append(process)
  return {name: "; ".join(f"process{'es' if len(who) > 1 else ''} {', '.join(map(str, who))}: "
                          f"{why}" for why, who in by_message.items())
          for name, by_message in seen.items()}


class UnionOfFailures:
  """time_candidates' `agree` across processes: each call publishes this
  process's failures of one step under a key of its own and returns the union
  of every process's; `failed` holds all agreed so far. A peer that does not
  answer within `timeout` seconds is a TimeoutError naming the step."""

  def __init__(self, ident: int, attempt: int, *parts, timeout: float):
    self._key = (ident, attempt, *parts)
    self._timeout = timeout
    self._exchanges = itertools.count()
    self.failed: dict[str, str] = {}

  def __call__(self, mine: dict[str, str]) -> dict[str, str]:
    exchange = next(self._exchanges)
    try:
      every = kv.all_gather(*self._key, exchange, value=mine, timeout_s=self._timeout)
    except TimeoutError as e:
      raise TimeoutError(
          f"jax_comm_gemm autotune: a process did not report its failures of exchange "
          f"{exchange} ({'/'.join(map(str, self._key[2:]))}) within {self._timeout:g} s; "
          f"the failures agreed before: {self.failed or 'none'}: {e}") from e
    agreed = union(every)
    self.failed.update(agreed)
    return agreed


# --- the check against XLA --------------------------------------------------------------

# How far a candidate's result may be from XLA's, over XLA's largest value per shard:
# rounding and summation order stay far below it, a wrong block does not.
AGREEMENT = 0.05
# A difference below NOISE times the result's largest value (over all its leaves) is
# rounding at any leaf: a leaf that small is the noise of sums that cancel (a
# training step's gradient of a key bias, which softmax makes zero: 6e-7 in bf16
# where weights are ~1, and any two summation orders differ by all of it).
NOISE = 2.0 ** -14


def mismatch(out, reference, tolerance: float = AGREEMENT) -> str | None:
  """What is wrong with `out` against `reference`, or None: each addressable
  shard compared on its own device, so no process waits for another."""
  pairs = list(zip(jax.tree.leaves(out), jax.tree.leaves(reference)))
  for got, expected in pairs:
    if got.shape != expected.shape:
      return f"shape {got.shape}, XLA's {expected.shape}"
  floor = NOISE * max((float(abs(s.data.astype("float32")).max()) for _, e in pairs
                       for s in e.addressable_shards if s.data.size), default=0.0)
  for got, expected in pairs:
    for mine, theirs in zip(got.addressable_shards, expected.addressable_shards):
      a, b = mine.data.astype("float32"), theirs.data.astype("float32")
      error, scale = float(abs(a - b).max()), float(abs(b).max())
      if not error <= max(tolerance * scale, floor):  # NaN too
        return (f"differs from XLA's by {error:.3g} on device {mine.device.id} "
                f"(XLA's largest value {scale:.3g})")
  return None


def against_xla():
  """time_candidates' `verify` for one problem: XLA's warm-up result, the
  first candidate's, is the reference for the others' (mismatch)."""
  reference = {}

  def verify(name, out):
    if name == "xla":
      reference["xla"] = out
      return None
    return mismatch(out, reference["xla"]) if "xla" in reference else None
  return verify


# --- autotune: each op alone -------------------------------------------------------------

def _random(mesh, shape, spec, dtype, seed, scale=1.0):
  sharding = NamedSharding(mesh, spec)
  make = jax.jit(lambda key: (scale * jax.random.normal(key, shape, "float32")).astype(dtype),
                 out_shardings=sharding)
  return make(jax.random.key(seed))


# A call's fixed cost where the group has NCCL symmetric memory (NVLink), and
# where it has not: with two ranks sharing a GPU every candidate timed 2.26 ms a
# call whatever its size, NCCL's network transport's cost per collective
# (docs/gpu-testing.md); across hosts over the network it is of that order too.
# Over the network it is paid at each of a ring's P - 1 steps: a lower bound
# where ranks share a GPU, whose calls took 20 ms at 4 ranks and 63 ms at 8.
CALL_S = MappingProxyType({True: 3e-5, False: 2.5e-3})


def iterations(p: Problem, seconds: float, symmetric_memory: bool = True) -> int:
  """Calls per timed batch, about `seconds / 10` of work, from the problem's
  size and whether its group has NCCL symmetric memory (connect's workspace
  probe), never from a timing: it must be the same in every process."""
  fixed = CALL_S[True] if symmetric_memory else CALL_S[False] * max(1, p.axis_size - 1)
  estimate = p.flop() / 4e14 + fixed
  return max(1, min(200, int(seconds / 10 / estimate)))


def _runnables(mesh, axis_name: str, p: Problem, seconds: float, plan: Plan) -> dict:
  """A compiled program per candidate of `p` on random data, under `plan`
  (the tuner's), as time_candidates takes them: ``(call, iterations)``, the
  error building it raised, or None."""
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
  # A layer's magnitudes (weights ~ k^-1/2): a GEMM's power, so its clock, depends on them.
  w = _random(mesh, w_shape, w_spec, p.dtype, 2, scale=p.k ** -0.5)
  # Every candidate has an entry, in the same order in every process.
  runs = {}
  fused = CublasMpBackend(plan=plan)
  for name in candidates(p):
    if not runnable(name, p, plan).ok:
      runs[name] = None
      continue
    backend = implementation(name, fused)

    def local(x, w, backend=backend, name=name):
      if p.fp8:  # the FP8 op, its fused steps on `name`'s collectives
        recipe = Fp8Recipe.from_key(p.fp8)
        collectives = fp8_collectives_of(name, fused)
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
                       lambda program: program(x, w),
                       iterations(p, seconds, symmetric_memory(workspace(size, plan))))
  return runs


# Raised when the timing or a candidate's algorithm changes: cached choices are measured again.
METHOD = 3


def signature() -> str:
  """The disk cache's section: this GPU model, these versions and candidates."""
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
  folder = os.path.dirname(path) or "."
  os.makedirs(folder, exist_ok=True)
  handle, temporary = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".",
                                       suffix=".tmp")
  try:
    os.fchmod(handle, 0o644)  # as open() would make it, not mkstemp's owner-only
    with os.fdopen(handle, "w") as f:
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
  order: `step` is traced (``jax.eval_shape``) under a copy of the plan in force
  that no trace saw before and that lists them; nothing else is traced again.

  >>> import jax.numpy as jnp
  >>> problems_of(lambda x: x + 1, jnp.zeros(2))  # no collective matmul
  []
  """
  found: list = []
  # A user's entry: the plan in force, read once, copied for this trace.
  with plan_lib.use(dataclasses.replace(current_plan(), tag=next(_TAGS), problems=found)):
    jax.eval_shape(step, *args)
  return list(dict.fromkeys(found))


def autotune(mesh, axis_name: str = "tp", problems=(), *,
             seconds_per_problem: float = 1.0) -> dict[Problem, tuple[str, str]]:
  """Measures `problems` (``problems_of`` lists a step's) on `axis_name` and
  publishes a routing plan with the choices (collective). Programs traced after
  it take them; those traced before keep their routes. Returns the choices;
  does nothing where nothing can be tuned (no cuBLASMp, measuring off, an axis
  of size 1).

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> autotune(mesh, "tp")  # on a CPU: nothing to tune
  {}
  """
  plan = current_plan()  # a user's entry: read once, passed to all below
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
    parts = ("autotune", index)
    mine, failed = timed(ident, attempt, parts, _runnables(mesh, axis_name, p,
                                                           seconds_per_problem, plan),
                         10, timeout, about=p.text())
    choices[p] = agreed_choice(ident, attempt, parts, mine, timeout, failed, decide)
  measured = {Problem(**q).text(): list(choices[Problem(**q)]) for q, _ in work["measure"]}
  remember(path, section, measured)
  return choices


# How long a writer waits for another job's write of the disk cache (a write takes milliseconds).
CACHE_LOCK_TIMEOUT_S = 60.0


def remember(path: str, section: str, entries: dict) -> None:
  """Adds `entries` to `section` of the disk cache at `path` (process 0 only;
  nothing where `path` is "" or there is nothing to add). The read, update and
  write hold a lock file beside the cache (``filelock``): two jobs on one
  machine that write at once both keep their entries."""
  if jax.process_index() == 0 and path and entries:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with FileLock(f"{path}.lock", timeout=CACHE_LOCK_TIMEOUT_S):
      cache = load_cache(path)
      cache.setdefault(section, {}).update(entries)
      save_cache(path, cache)


def timed(ident, attempt, parts: tuple, runs: dict, rounds: int, timeout: float,
          about: str) -> tuple[dict[str, float], dict[str, str]]:
  """(this process's time per candidate of `runs`, the failures every process
  agreed on), under key `parts` (each tuner's exchanges have their own); XLA's
  run is the reference, whose failure is an error naming `about`."""
  agree = UnionOfFailures(ident, attempt, *parts, "failed", timeout=timeout)
  mine = time_candidates(runs, rounds=rounds, warmup_rounds=WARMUP_ROUNDS, agree=agree,
                         verify=against_xla(), reference="xla", about=about)
  return mine, agree.failed


def agreed_choice(ident, attempt, parts: tuple, mine: dict[str, float], timeout: float,
                  failures: dict[str, str], decide_) -> tuple[str, str]:
  """Process 0's `decide_` from every process's times, naming the `failures`
  (the same in every process); every process takes it."""
  def decided(times):
    choice, why = decide_({name: [t[name] for t in times] for name in mine})
    return [choice, with_failures(why, failures)]

  return tuple(kv.leader_decides(ident, attempt, *parts, value=mine, timeout_s=timeout,
                                 decide=decided))


# --- autotune_step: the whole step ----------------------------------------------------------

# A plan other than XLA is taken only if the step is this much faster with it,
# XLA (the safe default) taking the tie: whole-step measurements of the same
# plans repeat within about 1-2% (docs/design.md#whole-step-tuning-autotune_step).
KEEP_MARGIN = 0.01
TUNED, XLA = "tuned", "xla"
# The plan of a step that nothing was measured for: it runs under the plan in force.
UNMEASURED = "unmeasured"


@dataclasses.dataclass(frozen=True)
class TunedStep:
  """A step function that carries its routing decisions: calling it (or
  ``lower``) runs `step` jitted under ``routes``, the plan that holds them;
  the process's own plan and its compiled programs are not touched. ``plan``
  says which plan was kept (``"tuned"``: the per-op choices, ``"xla"``, or the
  one implementation every op runs; ``"unmeasured"``: nothing was measured,
  the plan in force routes it) and ``why``: the measurement, or why nothing
  was measured.

  >>> import jax.numpy as jnp
  >>> tuned = TunedStep(lambda x: x * 2, REGISTRY.plan(), "unmeasured", "nothing to choose")
  >>> float(tuned(jnp.float32(3)))
  6.0
  """

  step: Callable
  routes: Plan
  plan: str
  why: str
  _jitted: Any = dataclasses.field(default=None, repr=False, compare=False)

  def __post_init__(self):
    jitted = self.step if hasattr(self.step, "lower") else jax.jit(self.step)
    object.__setattr__(self, "_jitted", jitted)

  def __call__(self, *args, **kwargs):
    with plan_lib.use(self.routes):
      return self._jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """The step lowered under its routes (``jax.jit(...).lower``)."""
    with plan_lib.use(self.routes):
      return self._jitted.lower(*args, **kwargs)


def step_plans(problems, chosen: dict, implementations=None, *, plan: Plan) -> dict[str, dict]:
  """{plan: {problem: (implementation, why)}} to time: the per-op choices
  (``tuned``), and every op on one implementation, for each of
  `implementations` (default: all) that runs every op of the step under
  `plan` (the tuner's), XLA always; per-op choices of one implementation are
  timed once, under its name."""
  names = _plan_names(implementations)
  plans = {name: {p: (name, "step-level comparison") for p in problems}
           for name in IMPLEMENTATIONS
           if name in names and all(name in CANDIDATES[p.op] and runnable(name, p, plan).ok
                                    for p in problems)}
  tuned = {name for name, _ in chosen.values()}
  if len(tuned) != 1 or not tuned <= plans.keys():
    plans = {TUNED: dict(chosen), **plans}
  return plans


def _plan_names(implementations) -> tuple[str, ...]:
  """XLA and `implementations` (default: all), or a ValueError naming what is allowed."""
  names = IMPLEMENTATIONS if implementations is None else (XLA, *implementations)
  unknown = sorted(set(names) - set(IMPLEMENTATIONS))
  if unknown:
    raise ValueError(f"autotune_step: implementations has {', '.join(map(repr, unknown))}; "
                     f"allowed: {', '.join(IMPLEMENTATIONS)}")
  return names


def decide_step(times: dict[str, list[float]],
                margin: float = KEEP_MARGIN) -> tuple[str, str]:
  """(plan, why) from each plan's seconds per step in every process: the
  fastest by the slowest process, unless XLA's step is within `margin` of it."""
  label = lambda plan: "per-op choices" if plan == TUNED else f"all {plan}"
  best, worst = fastest(times)
  if best != XLA and worst[best] > worst[XLA] * (1.0 - margin):
    best, verdict = XLA, f"XLA kept: a lead under {margin:.0%} is noise"
  else:
    verdict = f"{label(best)} kept"
  return best, f"step measured: {_listing(worst, label)} ({verdict})"


def autotune_step(mesh, axis_name: str, step, *args, iterations: int = 5, rounds: int = 10,
                  seconds_per_problem: float = 1.0, implementations=None) -> TunedStep:
  """Tunes every op `step(*args)` meets (as ``autotune`` does), times the step
  under each plan of :func:`step_plans` (`implementations` limits those of one
  implementation for every op: each costs a compile), and returns the step with
  the plan kept, a :class:`TunedStep` (collective; the plan is cached on disk,
  keyed by the step's problems and plans). Where there is nothing to choose,
  the step comes back under the plan in force, with the reason.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> tuned = autotune_step(mesh, "tp", lambda x: x + 1, jnp.zeros(2))
  >>> tuned.plan, tuned.why
  ('unmeasured', "nothing to choose: axis 'tp' has size 1: nothing to communicate")
  >>> tuned(jnp.zeros(2)).tolist()
  [1.0, 1.0]
  """
  # Bad input fails here, before any device work.
  _plan_names(implementations)
  for name, value in (("iterations", iterations), ("rounds", rounds)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"autotune_step: `{name}` must be a whole number of at least 1, "
                       f"got {value!r}")
  base = current_plan()  # a user's entry: read once, passed to all below
  why_not = tunable(mesh, axis_name, base)
  if why_not is not None:
    return TunedStep(step, base, UNMEASURED, f"nothing to choose: {why_not}")
  size = int(mesh.shape[axis_name])
  problems = [p for p in problems_of(step, *args) if p.axis_size == size]
  if not problems:
    return TunedStep(step, base, UNMEASURED, "the step meets no op that auto chooses for")
  chosen = measure(mesh, axis_name, problems, base,
                   seconds_per_problem=seconds_per_problem)
  plans = step_plans(problems, chosen, implementations, plan=base)
  ident = comm_id(mesh, axis_name)
  attempt = REGISTRY.next_attempt(("autotune_step", ident))
  timeout = base.settings.connect_timeout_s
  path = base.settings.autotune_cache
  key = (f"autotune_step margin={KEEP_MARGIN} plans={','.join(plans)} problems="
         + "; ".join(sorted(p.text() for p in problems)))
  cached = kv.from_leader(ident, attempt, "step", "cached", timeout_s=timeout,
                          make=lambda: load_cache(path).get(signature(), {}).get(key)
                          if path else None)
  routes = {name: base.with_decisions(decisions) for name, decisions in plans.items()}
  if cached is not None and cached[0] in plans:
    plan, why = cached[0], f"{cached[1]} (cached)"
  else:
    plan, why = _measure(ident, attempt, routes, step, args, iterations, rounds, timeout)
    remember(path, signature(), {key: [plan, why]})
  if plan != TUNED:
    routes[plan] = base.with_decisions({p: (name, why) for p, (name, _) in plans[plan].items()})
  return TunedStep(step, routes[plan], plan, why)


def _measure(ident, attempt, routes: dict[str, Plan], step, args, iterations, rounds,
             timeout) -> tuple[str, str]:
  """Compiles the step under each plan, times them all, and returns process
  0's decision; where the all-XLA step failed, every process raises alike."""
  runs = {}
  jitted = step if hasattr(step, "lower") else jax.jit(step)
  # XLA's step first: the others' results are checked against its (against_xla).
  for name, plan in sorted(routes.items(), key=lambda item: item[0] != XLA):
    runs[name] = build(lambda plan=plan: _compiled(jitted, plan, args),
                       lambda compiled: compiled(*args), iterations)
  mine, failed = timed(ident, attempt, ("step",), runs, rounds, timeout,
                       about="the step under the all-XLA plan")
  return agreed_choice(ident, attempt, ("step",), mine, timeout, failed, decide_step)


def _compiled(jitted, plan: Plan, args):
  """The step compiled ahead of time under `plan`: the executable keeps its choices."""
  with plan_lib.use(plan):
    return jitted.lower(*args).compile()
