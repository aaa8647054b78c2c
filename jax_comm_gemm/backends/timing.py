"""How candidates are timed and one is chosen, for ``autotune`` (each op alone)
and ``autotune_step`` (the whole step under each plan): interleaved rounds after
untimed rounds of load, medians, back-to-back batches, the slowest process's
time, and the candidates that failed anywhere skipped everywhere.
Why: docs/design.md#backendauto-and-autotuning.

Failures are agreed step by step. Each candidate is a collective program, so
every process must run the same ones in the same order: one that a process
skips leaves its peers waiting in it. A process that sees a candidate fail
(while building it, warming it up, checking its result or timing it) changes
nothing it runs on its own; after each of those steps every process publishes
the failures it saw through the key-value store, with a timeout, and all of
them drop the union (``UnionOfFailures``) before the next program runs. A
collective cannot do this: a peer that raised before it enqueued its part
would leave the others waiting in the exchange itself. Every process thus
ends with the same failures, each named with the processes that saw it and
the library's own message.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time

import jax

import jax_comm_gemm.runtime.kv as kv

log = logging.getLogger("jax_comm_gemm.autotune")

# The failure of a candidate that is no program here (None in `runs`).
CANNOT_RUN = "cannot run here"


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
  """A candidate as time_candidates takes it: compiled now, ``(lambda:
  call(program), iterations)`` with ``program = compile_()``, or the error
  that compiling raised (a string). Compiling touches no peer, so a candidate
  that fails to compile in one process is left out in all before any of them
  runs a candidate."""
  try:
    program = compile_()
  except Exception as e:  # noqa: BLE001  (a candidate this machine cannot build)
    return message(e)
  return (lambda: call(program), iterations)


def time_candidates(runs: dict, *, rounds: int, warmup_rounds: int = 0,
                    timer=time.perf_counter, wait=jax.block_until_ready,
                    agree=lambda failed: failed,
                    verify=lambda name, out: None) -> dict[str, float]:
  """Median seconds per call of each runnable, interleaved over `rounds`,
  after `warmup_rounds` alike untimed: load first, as the benchmark does, so
  that the times are those at the power-capped clocks of steady state, not
  of a GPU left idle by the compiles before.

  Each value of `runs` is ``(call, iterations)`` for a candidate built (and
  compiled) already; a string, the error that building it raised; or None for
  a candidate this process knows it cannot run (it counts as failed, without
  a warning). `verify(name, out)` sees each candidate's warm-up result and
  says what is wrong with it, or None; a wrong one counts as failed
  (against_xla()). ``call()`` enqueues one run and returns its result; a timed
  batch enqueues `iterations` of them and waits once at the end, so the time
  is the throughput of back-to-back calls, as in a training step (waiting
  after every call would add the host's launch latency to each and rank
  small problems otherwise than a step does: docs/design.md#backendauto-and-autotuning). A candidate that raises or is wrong gets ``inf`` (caught
  once per candidate at tuning time, never per call of a program).

  `agree` (UnionOfFailures across processes) takes the failures this process
  saw in one step, {name: message}, and returns those of every process; it is
  called after building, after each warm-up and check, and after each timed
  batch, the same number of times in every process, and every process skips
  what it returns from then on (module docstring). The exchange after a batch
  lies outside its timed span.

  Rounds alternate in order (a b c, then c b a), as the benchmark's do: under
  the power cap a batch's clock depends on the batch before it, and in one
  fixed order a candidate that always follows another is timed unlike the
  same program in the benchmark (docs/design.md#backendauto-and-autotuning).

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


# Untimed rounds before the timed ones: with `iterations`' batches of about a
# tenth of `seconds_per_problem` each, 3 rounds of 6 candidates are about 2 s
# of load at the default second, as long as the benchmark's own warm-up, so
# that the timed rounds run at the clocks of steady state.
WARMUP_ROUNDS = 3


def union(per_process: list[dict[str, str]]) -> dict[str, str]:
  """Every process's failures, {name: message} in process order, as one:
  each name with the processes that saw it and what they saw (processes
  are named only where there are several), in the order process 0 first,
  then each other, saw them.

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
  process's failures of one step under a key of its own
  (kv.key(ident, attempt, *parts, exchange, process)) and returns the union
  of every process's. Every process makes the same calls in the same order,
  so the exchanges match. `failed` holds every failure agreed so far, the
  same in every process.

  A peer that does not answer within `timeout` seconds (it died, or it is
  stuck in a candidate's collective) is a TimeoutError naming the step."""

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
