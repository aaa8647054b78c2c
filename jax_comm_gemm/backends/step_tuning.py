"""``autotune_step``: which plan makes the whole training step fastest: the
measured per-op choices, every op on XLA, or every op on one implementation?

``autotune`` times each op alone. Inside a step XLA's scheduler overlaps its
own collectives with independent GEMMs, which an op timed alone cannot show:
every op of a step may measure faster fused while the step is slower, and the
reverse (docs/design.md#whole-step-tuning-autotune_step). So this times the
step itself under each plan (``step_plans``), interleaved, and takes the
fastest plan only where it leads the all-XLA step by more than the noise of
the measurement (``KEEP_MARGIN``); otherwise the step runs on XLA.
Collective like ``autotune``: process 0 decides from the slowest process's
times and publishes the decision.

It returns a :class:`TunedStep`: the step, jitted, under a routing plan of its
own that carries the decisions (runtime/plan.py). Nothing else changes: the
process's plan and every program compiled under it stay as they were.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax

import jax_comm_gemm.runtime.kv as kv
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.backends.auto import CANDIDATES, IMPLEMENTATIONS
from jax_comm_gemm.backends.timing import (WARMUP_ROUNDS, UnionOfFailures, build, fastest,
                                           time_candidates, with_failures)
from jax_comm_gemm.backends.tuning import (load_cache, measure, problems_of, remember, signature,
                                           tunable)
from jax_comm_gemm.backends.verify import against_xla
from jax_comm_gemm.runtime import comm_id
from jax_comm_gemm.runtime.plan import Plan
from jax_comm_gemm.runtime.registry import REGISTRY, current_plan


# A plan other than XLA is taken only if the step is this much faster with it,
# XLA (the safe default) taking the tie: whole-step measurements of the same
# plans repeat within about 1-2% (docs/design.md#whole-step-tuning-autotune_step).
KEEP_MARGIN = 0.01
TUNED, XLA = "tuned", "xla"


@dataclasses.dataclass(frozen=True)
class TunedStep:
  """A step function that carries its routing decisions.

  Calling it runs `step` jitted (or as given, if it is already a jitted
  function) under ``routes``, the plan that holds the decisions; ``lower``
  lowers it alike. The process's own plan, and the programs compiled under
  it, are not touched.

  Attributes:
    step: the step function, as given to ``autotune_step``.
    routes: the routing plan its calls run under.
    plan: which plan was kept: ``"tuned"`` (the per-op choices), ``"xla"``,
      or the one implementation every op runs.
    why: the measurement, or why nothing was measured.

  >>> import jax.numpy as jnp
  >>> tuned = TunedStep(lambda x: x * 2, current_plan(), "tuned", "nothing to choose")
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


def step_plans(problems, chosen: dict, implementations=None) -> dict[str, dict]:
  """Each plan to time, as {plan: {problem: (implementation, why)}}: the
  per-op choices (``tuned``), and every op on one implementation, for each of
  `implementations` (default: all) that can run every op of the step, XLA
  always among them. Where the per-op choices are all one implementation,
  that plan is timed once, under the implementation's name."""
  names = _plan_names(implementations)
  ops = {p.op for p in problems}
  plans = {name: {p: (name, "step-level comparison") for p in problems}
           for name in IMPLEMENTATIONS
           if name in names and all(name in CANDIDATES[op] for op in ops)}
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
  parts = ", ".join(f"{label(plan)} {t * 1e3:.3f} ms" if math.isfinite(t) else
                    f"{label(plan)} failed"
                    for plan, t in sorted(worst.items(), key=lambda i: i[1]))
  return best, f"step measured: {parts} ({verdict})"


def autotune_step(mesh, axis_name: str, step, *args, iterations: int = 5, rounds: int = 10,
                  seconds_per_problem: float = 1.0, implementations=None) -> TunedStep:
  """Tunes every op `step(*args)` meets (as ``autotune`` does), then times the
  step under each plan of ``step_plans`` (`implementations` limits the plans
  of one implementation for every op: each costs a compile of the step), and
  returns the step with the plan taken, as a :class:`TunedStep`. The plan is
  kept in autotune's disk cache, keyed by the step's problems and plans, and
  taken from it without compiling or timing the next time. Where there is
  nothing to choose (no cuBLASMp, measuring off, an axis of size 1, a step
  with no op to choose for), the step comes back with the plan in force and
  the reason. Call it in every process: it is collective. It leaves the
  process's plan, and every program compiled under it, as they were.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> tuned = autotune_step(mesh, "tp", lambda x: x + 1, jnp.zeros(2))
  >>> tuned.why
  "nothing to choose: axis 'tp' has size 1: nothing to communicate"
  >>> tuned(jnp.zeros(2)).tolist()
  [1.0, 1.0]
  """
  _plan_names(implementations)  # bad input fails here, before any device work
  base = current_plan()
  why_not = tunable(mesh, axis_name, base)
  if why_not is not None:
    return TunedStep(step, base, TUNED, f"nothing to choose: {why_not}")
  size = int(mesh.shape[axis_name])
  problems = [p for p in problems_of(step, *args) if p.axis_size == size]
  if not problems:
    return TunedStep(step, base, TUNED, "the step meets no op that auto chooses for")
  chosen = measure(mesh, axis_name, problems, base,
                   seconds_per_problem=seconds_per_problem)
  plans = step_plans(problems, chosen, implementations)
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
  """Compiles the step under each plan, times them all interleaved, and
  returns process 0's decision. Every process learns of every plan that
  failed in any (to compile, to run, to match XLA's result, while timed)
  before the next plan runs, and skips it; where every plan failed, every
  process raises the same RuntimeError naming each plan's failure."""
  runs = {}
  jitted = step if hasattr(step, "lower") else jax.jit(step)
  # XLA's step first: the others' results are checked against its (against_xla).
  for name, plan in sorted(routes.items(), key=lambda item: item[0] != XLA):
    runs[name] = build(lambda plan=plan: _compiled(jitted, plan, args),
                       lambda compiled: compiled(*args), iterations)
  agree = UnionOfFailures(ident, attempt, "step", "failed", timeout=timeout)
  mine = time_candidates(runs, rounds=rounds, warmup_rounds=WARMUP_ROUNDS, agree=agree,
                         verify=against_xla())
  if all(name in agree.failed for name in mine):
    raise RuntimeError("jax_comm_gemm.autotune_step: every plan of the step failed: " + ", ".join(
        f"{name} ({why})" for name, why in agree.failed.items()))
  return agree_on_step(ident, attempt, mine, timeout, agree.failed)


def _compiled(jitted, plan: Plan, args):
  """The step compiled ahead of time under `plan`: the executable keeps its choices."""
  with plan_lib.use(plan):
    return jitted.lower(*args).compile()


def agree_on_step(ident, attempt, mine: dict[str, float], timeout: float,
                  failures: dict[str, str] | None = None) -> tuple[str, str]:
  """Process 0 decides from every process's times (``decide_step``), naming
  the plans that failed (`failures`, the same in every process); all take
  its decision."""
  def decided(times):
    plan, why = decide_step({name: [t[name] for t in times] for name in mine})
    return [plan, with_failures(why, failures or {})]

  plan, why = kv.leader_decides(ident, attempt, "step", value=mine, timeout_s=timeout,
                                decide=decided)
  return plan, why
