"""``autotune_step``: which plan makes the whole training step fastest: the
measured per-op choices, every op on XLA, or every op on one implementation?

``autotune`` times each op alone. Inside a step XLA's scheduler overlaps its
own collectives with independent GEMMs, which an op timed alone cannot show:
on 2xH200 every op of the byte-level GPT measured faster fused, yet the step
was 3-5% slower (GPU run 16). And the reverse: in the SP MLP step at
8192x8192x7168 the per-op choices were 1.215 of the GEMM-only floor and XLA
1.229, while every op on ``pipelined_ce`` was 1.170 (GPU run 37). So this
times the step itself under each plan (``step_plans``), interleaved, and
takes the fastest plan only where it leads the all-XLA step by more than the
noise of the measurement (``KEEP_MARGIN``); otherwise the step runs on XLA.
Collective like ``autotune``: process 0 decides from the slowest process's
times and publishes the decision.
"""

from __future__ import annotations

import math

import jax

import jax_comm_gemm.runtime.kv as kv
from jax_comm_gemm.backends.auto import CANDIDATES, IMPLEMENTATIONS
from jax_comm_gemm.backends.tuning import (WARMUP_ROUNDS, autotune, load_cache, save_cache,
                                           signature, time_candidates, union_of_failures)
from jax_comm_gemm.backends.verify import against_xla
from jax_comm_gemm.runtime import REGISTRY, comm_id, settings


# A plan other than XLA is taken only if the step is this much faster with it,
# XLA (the safe default) taking the tie. Runs 20-21 saw autotune_step and a
# later benchmark of the same steps differ by up to 2%; in run 39 the two put
# the same plan first at all four MLP shapes, and the 2% margin of then kept
# XLA at 8192x8192x28672 where every op on pipelined_ce led by 1.7% in
# autotune_step and 3.1% in the benchmark. 10 rounds (from 6) since, against
# the noise a smaller margin lets through.
KEEP_MARGIN = 0.01
TUNED, XLA = "tuned", "xla"


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
  worst = {plan: max(per_process) for plan, per_process in times.items()}
  best = min(worst, key=lambda plan: (worst[plan], plan))
  if best != XLA and worst[best] > worst[XLA] * (1.0 - margin):
    best, verdict = XLA, f"XLA kept: a lead under {margin:.0%} is noise"
  else:
    verdict = f"{label(best)} kept"
  parts = ", ".join(f"{label(plan)} {t * 1e3:.3f} ms" if math.isfinite(t) else
                    f"{label(plan)} failed"
                    for plan, t in sorted(worst.items(), key=lambda i: i[1]))
  return best, f"step measured: {parts} ({verdict})"


def autotune_step(mesh, axis_name: str, step, *args, iterations: int = 5, rounds: int = 10,
                  seconds_per_problem: float = 1.0, implementations=None) -> tuple[str, str]:
  """Tunes every op `step(*args)` meets (``autotune``), then times the step
  under each plan of ``step_plans`` (`implementations` limits the plans of
  one implementation for every op: each costs a compile of the step) and
  records the plan taken for every op. The plan is kept in autotune's disk
  cache, keyed by the step's problems and plans, and taken from it without
  compiling or timing the next time. Returns (plan, why): ``"tuned"`` (the
  per-op choices), ``"xla"``, or the one implementation every op runs;
  ("tuned", why) without timing where there is nothing to choose. Call it in
  every process, before compiling the step for real; it clears jax's caches."""
  _plan_names(implementations)  # bad input fails here, before any device work
  if settings.autotune(IMPLEMENTATIONS) != "on" or not REGISTRY.cublasmp_status().ok:
    return TUNED, "nothing to choose: measuring is off or cuBLASMp cannot run"
  REGISTRY.forget_seen()
  jax.eval_shape(step, *args)
  size = int(mesh.shape[axis_name])
  problems = [p for p in REGISTRY.seen() if p.axis_size == size]  # autotune's, too
  autotune(mesh, axis_name, seconds_per_problem=seconds_per_problem)
  jax.clear_caches()
  if not problems:
    return TUNED, "the step meets no op that auto chooses for"
  plans = step_plans(problems, {p: REGISTRY.decision(p) for p in problems}, implementations)
  ident = comm_id(mesh, axis_name)
  attempt = REGISTRY.next_attempt(("autotune_step", ident))
  key = (f"autotune_step margin={KEEP_MARGIN} plans={','.join(plans)} problems="
         + "; ".join(sorted(p.text() for p in problems)))
  cached = _cached(ident, attempt, key)
  if cached is not None and cached[0] in plans:
    plan, why = cached[0], f"{cached[1]} (cached)"
  else:
    plan, why = _measure(ident, attempt, plans, step, args, iterations, rounds)
    _remember(key, plan, why)
  for p, (name, reason) in plans[plan].items():
    REGISTRY.record_decision(p, (name, reason if plan == TUNED else why))
  jax.clear_caches()
  return plan, why


def _measure(ident, attempt, plans, step, args, iterations, rounds) -> tuple[str, str]:
  """Compiles the step under each plan, times them all interleaved, and
  returns process 0's decision."""
  runs = {}
  # XLA's step first: the others' results are checked against its (against_xla).
  for plan, decisions in sorted(plans.items(), key=lambda item: item[0] != XLA):
    for p, decision in decisions.items():
      REGISTRY.record_decision(p, decision)
    jax.clear_caches()
    # Compiled ahead of time: each executable keeps the choices it was traced
    # with, whatever the caches hold later.
    compiled = jax.jit(step).lower(*args).compile()
    runs[plan] = (lambda compiled=compiled: compiled(*args), iterations)
  # Every process skips a plan that failed to run in any (a collective plan
  # that one process skipped would leave the others waiting in it).
  agree = union_of_failures(ident, attempt, "step", "failed",
                            timeout=settings.connect_timeout_s())
  mine = time_candidates(runs, rounds=rounds, warmup_rounds=WARMUP_ROUNDS, agree=agree,
                         verify=against_xla())
  return _agree(ident, attempt, mine)


def _cached(ident, attempt, key: str):
  """[plan, why] from the disk cache, or None: process 0 reads it, every
  process takes its answer."""
  lead = jax.process_index() == 0
  path = settings.autotune_cache()
  entry = load_cache(path).get(signature(), {}).get(key) if lead and path else None
  return kv.broadcast(ident, attempt, "step", "cached", value=entry,
                      timeout_s=settings.connect_timeout_s())


def _remember(key: str, plan: str, why: str) -> None:
  path = settings.autotune_cache()
  if jax.process_index() == 0 and path:
    cache = load_cache(path)
    cache.setdefault(signature(), {})[key] = [plan, why]
    save_cache(path, cache)


def _agree(ident, attempt, mine: dict[str, float]) -> tuple[str, str]:
  """Process 0 decides from every process's times; all take its decision."""
  timeout = settings.connect_timeout_s()
  times = kv.gather(ident, attempt, "step", value=mine, timeout_s=timeout)
  decision = None if times is None else decide_step(
      {plan: [t[plan] for t in times] for plan in mine})
  plan, why = kv.broadcast(ident, attempt, "step", "decision", value=decision,
                           timeout_s=timeout)
  return plan, why
