"""``autotune_step``: is the whole training step faster with the measured
per-op choices than with every op on XLA? If not, XLA it is.

``autotune`` times each op alone. Inside a step XLA's scheduler overlaps its
own collectives with independent GEMMs, which an op timed alone cannot show:
on 2xH200 every op of the byte-level GPT measured faster fused, yet the step
was 3-5% slower (GPU run 16). So this times the step itself, both ways,
interleaved, and keeps the per-op choices only where they lead by more than
the noise of the measurement (``KEEP_MARGIN``); otherwise the step runs on
XLA. Collective like ``autotune``: process 0 decides from the slowest
process's times and publishes the decision.
"""

from __future__ import annotations

import json

import jax

import jax_comm_gemm.runtime.kv as kv
from jax_comm_gemm.backends.auto import IMPLEMENTATIONS
from jax_comm_gemm.backends.tuning import autotune, time_candidates
from jax_comm_gemm.runtime import REGISTRY, comm_id, settings


# The per-op choices are kept only if the step is this much faster with them:
# on 2xH200 the same comparison differed by up to 2% between autotune_step and
# a later benchmark of the same steps (GPU runs 20-21), so a smaller lead is
# noise, and XLA (the safe default) takes the tie.
KEEP_MARGIN = 0.02


def decide_step(tuned: list[float], xla: list[float],
                margin: float = KEEP_MARGIN) -> tuple[bool, str]:
  """(keep the per-op choices?, why) from each process's seconds per step."""
  a, b = max(tuned), max(xla)
  keep = a <= b * (1.0 - margin)
  return keep, (f"step measured: per-op choices {a * 1e3:.3f} ms, all XLA {b * 1e3:.3f} ms "
                f"({'kept' if keep else f'XLA kept: a lead under {margin:.0%} is noise'})")


def autotune_step(mesh, axis_name: str, step, *args, iterations: int = 5, rounds: int = 6,
                  seconds_per_problem: float = 1.0) -> tuple[bool, str]:
  """Tunes every op `step(*args)` meets (``autotune``), then times the step
  with those choices against the step with all of them on XLA, and records
  XLA for all of them if that was faster. Returns (kept?, why); (True, why)
  without timing where there is nothing to choose. Call it in every process,
  before compiling the step for real; it clears jax's caches."""
  if settings.autotune(IMPLEMENTATIONS) != "on" or not REGISTRY.cublasmp_status().ok:
    return True, "nothing to choose: measuring is off or cuBLASMp cannot run"
  REGISTRY.forget_seen()
  jax.eval_shape(step, *args)
  problems = REGISTRY.seen()
  autotune(mesh, axis_name, seconds_per_problem=seconds_per_problem)
  jax.clear_caches()
  if not problems:
    return True, "the step meets no op that auto chooses for"
  chosen = {p: REGISTRY.decision(p) for p in problems}
  # Compiled ahead of time: each executable keeps the choices it was traced
  # with, whatever the caches hold later.
  tuned = jax.jit(step).lower(*args).compile()
  for p in problems:
    REGISTRY.record_decision(p, ("xla", "step-level comparison"))
  jax.clear_caches()
  xla = jax.jit(step).lower(*args).compile()
  runs = {"tuned": (lambda: tuned(*args), iterations), "xla": (lambda: xla(*args), iterations)}
  mine = time_candidates(runs, rounds=rounds)
  keep, why = _agree(mesh, axis_name, mine)
  for p in problems:
    REGISTRY.record_decision(p, chosen[p] if keep else ("xla", why))
  jax.clear_caches()
  return keep, why


def _agree(mesh, axis_name, mine: dict[str, float]) -> tuple[bool, str]:
  """Process 0 decides from every process's times; all take its decision."""
  if not kv.multi_process():
    return decide_step([mine["tuned"]], [mine["xla"]])
  ident = comm_id(mesh, axis_name)
  attempt = REGISTRY.next_attempt(("autotune_step", ident))
  timeout = settings.connect_timeout_s()
  me = jax.process_index()
  kv.publish(kv.key(ident, attempt, "step", me), json.dumps(mine))
  if me == 0:
    times = [mine] + [json.loads(kv.fetch(kv.key(ident, attempt, "step", other), timeout))
                      for other in range(1, jax.process_count())]
    decision = decide_step([t["tuned"] for t in times], [t["xla"] for t in times])
    kv.publish(kv.key(ident, attempt, "step", "decision"), json.dumps(decision))
    return decision
  keep, why = json.loads(kv.fetch(kv.key(ident, attempt, "step", "decision"), timeout))
  return keep, why
