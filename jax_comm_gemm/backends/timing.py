"""How candidates are timed and one is chosen, for ``autotune`` (each op alone)
and ``autotune_step`` (the whole step under each plan): interleaved rounds after
untimed rounds of load, medians, back-to-back batches, the slowest process's
time, and the candidates that failed anywhere skipped everywhere.
Why: docs/design.md#backendauto-and-autotuning.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import jax

import jax_comm_gemm.runtime.kv as kv

log = logging.getLogger("jax_comm_gemm.autotune")


def fastest(times: dict[str, list[float]]) -> tuple[str, dict[str, float]]:
  """(the fastest, each one's time) where each one's time is its slowest
  process's: a collective step runs at the pace of its slowest rank. Ties go
  to the first name in order, so every process would pick alike."""
  worst = {name: max(per_process) for name, per_process in times.items()}
  return min(worst, key=lambda name: (worst[name], name)), worst


def decide(times: dict[str, list[float]]) -> tuple[str, str]:
  """(fastest candidate, why) from each candidate's time (seconds) in every
  process; a candidate that failed has ``inf``. The slowest process counts.

  >>> decide({"xla": [1e-3, 2e-3], "ring": [1.5e-3, 1.5e-3]})
  ('ring', 'measured: ring 1.500 ms, xla 2.000 ms')
  """
  chosen, worst = fastest(times)
  if not math.isfinite(worst[chosen]):
    return "xla", "every candidate failed to run; XLA is the fallback"
  parts = ", ".join(f"{name} {t * 1e3:.3f} ms" if math.isfinite(t) else f"{name} failed"
                    for name, t in sorted(worst.items(), key=lambda kv_: kv_[1]))
  return chosen, f"measured: {parts}"


def time_candidates(runs: dict, *, rounds: int, warmup_rounds: int = 0,
                    timer=time.perf_counter, wait=jax.block_until_ready,
                    agree=lambda failed: failed,
                    verify=lambda name, out: None) -> dict[str, float]:
  """Median seconds per call of each runnable, interleaved over `rounds`,
  after `warmup_rounds` alike untimed: load first, as the benchmark does, so
  that the times are those at the power-capped clocks of steady state, not
  of a GPU left idle by the compiles before.

  Each value of `runs` is ``(call, iterations)``, or None for a candidate this
  process knows it cannot run (it counts as failed, without a warning).
  `verify(name, out)` sees each candidate's warm-up result and says what is
  wrong with it, or None; a wrong one counts as failed (against_xla()).
  ``call()`` enqueues one run and returns its result; a timed batch enqueues
  `iterations` of them and waits once at the end, so the time is the
  throughput of back-to-back calls, as in a training step (waiting after
  every call would add the host's launch latency to each, which made the
  fused op look faster than XLA at 4096^3 on 2xH200 while it was slower back
  to back). A runnable that raises
  gets ``inf`` (caught once per candidate at tuning time, never per call of a
  program). `agree` turns this process's set of candidates that failed to warm
  up into the set every process skips (a collective candidate that one
  process skipped would leave the others waiting in it).

  Rounds alternate in order (a b c, then c b a), as the benchmark's do: under
  the power cap a batch's clock depends on the batch before it, and in one
  fixed order a candidate that always follows another is timed unlike the
  same program in the benchmark (docs/design.md#backendauto-and-autotuning).

  >>> times = time_candidates({"a": (lambda: 1, 2)}, rounds=3, wait=lambda out: None)
  >>> sorted(times)
  ['a']
  """
  samples = {name: [] for name in runs}
  failed = set()
  for name, run in runs.items():  # compile and warm up, untimed
    if run is None:
      failed.add(name)
      continue
    log.debug("autotune: warming up %s", name)
    try:
      out = run[0]()
      wait(out)
    except Exception as e:  # noqa: BLE001  (a candidate this machine cannot run)
      log.warning("autotune: candidate %s failed: %s", name, str(e).splitlines()[0][:300])
      failed.add(name)
      continue
    wrong = verify(name, out)
    if wrong is not None:
      log.warning("autotune: candidate %s gave a wrong result: %s", name, wrong)
      failed.add(name)
  failed = set(agree(failed))
  for index in range(warmup_rounds + rounds):
    order = list(runs.items()) if index % 2 == 0 else list(runs.items())[::-1]
    for name, run in order:
      if name in failed:
        continue
      call, iterations = run
      log.debug("autotune: timing %s", name)
      try:
        start = timer()
        out = None
        for _ in range(iterations):
          out = call()
        wait(out)
        if index >= warmup_rounds:
          samples[name].append((timer() - start) / iterations)
      except Exception as e:  # noqa: BLE001  (a candidate this machine cannot run)
        log.warning("autotune: candidate %s failed: %s", name, str(e).splitlines()[0][:300])
        failed.add(name)
  return {name: (statistics.median(s) if s and name not in failed else math.inf)
          for name, s in samples.items()}


# Untimed rounds before the timed ones: with `iterations`' batches of about a
# tenth of `seconds_per_problem` each, 3 rounds of 6 candidates are about 2 s
# of load at the default second, as long as the benchmark's own warm-up, so
# that the timed rounds run at the clocks of steady state.
WARMUP_ROUNDS = 3


def union_of_failures(ident: int, attempt: int, *parts, timeout: float):
  """time_candidates' `agree`: every process publishes the candidates it
  failed to warm up (under kv.key(ident, attempt, *parts, process)) and skips
  the union of them."""
  def agree(failed):
    return set().union(*kv.all_gather(ident, attempt, *parts, value=sorted(failed),
                                      timeout_s=timeout))
  return agree
