"""Helpers shared by the benchmark scripts: GPU state from nvidia-smi, machine
facts, a time budget, a hang watchdog, JSON written atomically, and the
interleaved steady-state timing loop for jax callables.

Importing this module imports neither jax nor torch (the torch peer uses it too).

How we time (docs/performance.md, "How to reproduce"): the H200s power-cap
and clock down within seconds of sustained GEMMs, so every shape gets several
seconds of load first; the variants of one shape then run interleaved in rounds
(A B C ... then ... C B A, so that no variant always follows the same one); each
variant's time in a round is the wall time of `iters` back-to-back calls ended by
one sync, divided by `iters`; the result is the median over rounds, and
`over_floor` is the median over rounds of time(variant) / time(floor) in the same
round. The clocks and power are sampled after the warm-up and after the rounds.

Longer than 300 lines because the timing loop, the clock readings, the budget and the hang watchdog are shared by bench.py and both peers, and belong together.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable

# ----------------------------------------------------------------------------
# GPU state and machine facts


_SMI_FIELDS = ("index", "clocks.sm", "clocks.mem", "power.draw", "power.limit",
               "temperature.gpu", "utilization.gpu")


def gpu_state() -> list[dict]:
  """One dict per GPU: index, clock_sm_mhz, clock_mem_mhz, power_w, power_limit_w,
  temp_c, util_pct. Empty where nvidia-smi is missing or fails."""
  if not shutil.which("nvidia-smi"):
    return []
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(_SMI_FIELDS),
                          "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=15).stdout
  except Exception:  # noqa: BLE001  (a missing reading must never stop a run)
    return []
  keys = ("gpu", "clock_sm_mhz", "clock_mem_mhz", "power_w", "power_limit_w", "temp_c",
          "util_pct")
  rows = []
  for line in out.strip().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(keys):
      continue
    row = {}
    for key, value in zip(keys, parts):
      try:
        row[key] = float(value) if "." in value else int(value)
      except ValueError:
        row[key] = value
    rows.append(row)
  return rows


def gpu_state_async() -> Callable[[], list[dict]]:
  """Starts reading the GPU state in a thread (the GPUs keep working meanwhile);
  the returned function waits for the reading and returns it."""
  holder: dict = {}
  thread = threading.Thread(target=lambda: holder.update(state=gpu_state()), daemon=True)
  thread.start()

  def result() -> list[dict]:
    thread.join(timeout=30)
    return holder.get("state", [])
  return result


def gpu_state_str(state: list[dict]) -> str:
  if not state:
    return "no nvidia-smi"
  return " | ".join(
      f"GPU{s.get('gpu')} {s.get('clock_sm_mhz')} MHz {s.get('power_w')} W "
      f"{s.get('temp_c')} C" for s in state)


def machine_facts() -> dict:
  facts: dict[str, Any] = {
      "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "host": platform.node(), "python": platform.python_version(),
      "cpus": os.cpu_count(),
      "env": {k: os.environ.get(k) for k in (
          "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
          "XLA_FLAGS", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")
          if os.environ.get(k) is not None},
  }
  # Every jax_comm_gemm setting the run had (JAX_COMM_GEMM_BACKEND, ...).
  facts["env"].update(sorted((k, v) for k, v in os.environ.items()
                             if k.startswith("JAX_COMM_GEMM_")))
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=15).stdout
      facts["gpus"] = [line.strip() for line in out.strip().splitlines()]
    except Exception as e:  # noqa: BLE001
      facts["gpus"] = [f"nvidia-smi failed: {e}"]
  return facts


# ----------------------------------------------------------------------------
# Output


def write_json(path: str | None, data: dict) -> None:
  """Writes atomically (a killed run leaves the previous complete file)."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, default=str)
  os.replace(tmp, path)


def resume_from(path: str | None, result: dict) -> set:
  """For a peer's --resume: keeps the finished shapes of an earlier attempt's
  JSON in `result`, records each shape that hung as an error, and returns the
  (op, shape_str) pairs not to run again."""
  if not path or not os.path.exists(path):
    return set()
  try:
    with open(path) as f:
      old = json.load(f)
  except Exception:  # noqa: BLE001
    return set()
  result["records"] = [r for r in old.get("records", []) if "variants" in r or "error" in r]
  result["hangs"] = old.get("hangs", [])
  result["attempts"] = old.get("attempts", 1) + 1
  skip = {(r.get("op"), r.get("shape_str")) for r in result["records"]}
  for h in result["hangs"]:
    key = (h.get("op"), h.get("shape"))
    if key[0] and key not in skip:
      result["records"].append({"op": key[0], "shape": [int(v) for v in key[1].split("x")],
                                "shape_str": key[1], "error": f"hung: {h.get('what')}"})
      skip.add(key)
  return skip


def say(*args, prefix: str = "") -> None:
  print(prefix + " ".join(str(a) for a in args), flush=True)


def shape_str(shape) -> str:
  return "x".join(str(int(s)) for s in shape)


def parse_shape(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.lower().replace("×", "x").split("x"))


def short_error(e: BaseException, limit: int = 400) -> str:
  text = f"{type(e).__name__}: {e}".replace("\n", " ")
  return text[:limit]


# ----------------------------------------------------------------------------
# Budget


class Budget:
  """A wall-clock budget split among named parts by weight. A part's share is
  computed when it starts, from what is left, so time one part leaves unused
  goes to the parts after it."""

  def __init__(self, total_s: float, weights: dict[str, float]):
    self.t0 = time.time()
    self.total_s = float(total_s)
    self.weights = dict(weights)
    self.done: set[str] = set()
    self.part, self.part_start, self.part_s = None, self.t0, self.total_s

  def left(self) -> float:
    return self.total_s - (time.time() - self.t0)

  def start(self, part: str) -> float:
    """Begins `part`; returns its share in seconds."""
    pending = [p for p in self.weights if p not in self.done or p == part]
    total_w = sum(self.weights[p] for p in pending) or 1.0
    self.part, self.part_start = part, time.time()
    self.part_s = max(0.0, self.left()) * self.weights.get(part, 0.0) / total_w
    self.done.add(part)
    return self.part_s

  def part_left(self) -> float:
    return min(self.part_s - (time.time() - self.part_start), self.left())

  def fits(self, estimate_s: float, slack: float = 1.15) -> bool:
    """Whether a step of about `estimate_s` fits in the current part (with
    slack) and in the whole budget."""
    return estimate_s <= self.part_left() * slack + 1.0 and estimate_s <= self.left()


# ----------------------------------------------------------------------------
# Hang watchdog


class Watchdog:
  """If no `tick` comes for `timeout_s`, calls `on_hang(what)` (which should save
  what is known), dumps every thread's stack and exits with status 3. A C-level
  faulthandler timer at 1.25x the timeout is the backstop for a hang that holds
  the GIL."""

  def __init__(self, timeout_s: float, on_hang: Callable[[str], None] | None = None):
    self.timeout_s = timeout_s
    self.on_hang = on_hang
    self.what = "start"
    self.last = time.time()
    self._stop = False
    if timeout_s and timeout_s > 0:
      threading.Thread(target=self._run, daemon=True).start()
      faulthandler.dump_traceback_later(timeout_s * 1.25, repeat=False, exit=True)

  def tick(self, what: str) -> None:
    self.what, self.last = what, time.time()
    if self.timeout_s and self.timeout_s > 0:
      faulthandler.cancel_dump_traceback_later()
      faulthandler.dump_traceback_later(self.timeout_s * 1.25, repeat=False, exit=True)

  def stop(self) -> None:
    self._stop = True
    faulthandler.cancel_dump_traceback_later()

  def _run(self) -> None:
    while not self._stop:
      time.sleep(1.0)
      if not self._stop and time.time() - self.last > self.timeout_s:
        say(f"WATCHDOG: no progress for {self.timeout_s:.0f} s at: {self.what}")
        try:
          if self.on_hang:
            self.on_hang(self.what)
        finally:
          faulthandler.dump_traceback(all_threads=True)
          sys.stdout.flush()
          os._exit(3)


# ----------------------------------------------------------------------------
# Interleaved timing of jax callables


def median(values):
  v = sorted(values)
  if not v:
    return None
  mid = len(v) // 2
  return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def time_interleaved(fns: dict[str, Callable], args: dict[str, tuple], *,
                     floor: str | None = "floor", rounds: int = 8,
                     target_ms: float = 40.0, warmup_s: float = 3.0,
                     max_iters: int = 300, sync_each: bool = False,
                     agree_max: Callable | None = None,
                     tick: Callable[[str, str | None], None] | None = None,
                     on_warm: Callable[[], None] | None = None,
                     sync: Callable[[Any], None] | None = None,
                     align: Callable[[], None] | None = None) -> dict:
  """Steady-state interleaved timing of callables that were already run once.

  `sync(out)` waits for the device (default: jax.block_until_ready);
  `align()` runs before each timed block (a barrier, in multi-process torch);
  `agree_max(list[float]) -> list[float]` makes every process use the same counts
  and the same (slowest) per-round times in multi-process runs. `sync_each`
  waits for every call (XLA:CPU's collectives can starve its thread pool when
  many calls are queued; never on GPUs).
  Returns {name: {"median_ms", "over_floor", "rounds_ms", "ratios", "iters"}}."""
  if sync is None:
    import jax  # noqa: PLC0415
    sync = jax.block_until_ready
  agree = agree_max or (lambda v: v)
  tick = tick or (lambda phase, variant=None: None)
  align = align or (lambda: None)
  names = list(fns)
  if not names:
    return {}

  def run(name, k):
    f, a = fns[name], args[name]
    out = None
    for _ in range(k):
      out = f(*a)
      if sync_each:
        sync(out)
    sync(out)

  once = []
  for name in names:
    tick("calibrate", name)
    best = float("inf")
    for _ in range(2):
      align()
      t = time.perf_counter()
      run(name, 1)
      best = min(best, time.perf_counter() - t)
    once.append(best * 1e3)
  once = agree(once)
  iters = {n: int(max(3, min(max_iters, math.ceil(target_ms / max(o, 1e-3)))))
           for n, o in zip(names, once)}
  per_round_s = sum(iters[n] * o for n, o in zip(names, once)) / 1e3
  warm_rounds = int(max(1, math.ceil(warmup_s / max(per_round_s, 1e-3))))
  warm_rounds = int(agree([float(warm_rounds)])[0])
  for r in range(warm_rounds):
    for name in names:
      tick(f"warm-up round {r}/{warm_rounds}", name)
      run(name, iters[name])
  if on_warm:
    on_warm()
  times: dict[str, list[float]] = {n: [] for n in names}
  for r in range(rounds):
    order = names if r % 2 == 0 else names[::-1]
    for name in order:
      tick(f"round {r}/{rounds}", name)
      align()
      t = time.perf_counter()
      run(name, iters[name])
      times[name].append((time.perf_counter() - t) / iters[name] * 1e3)
  flat = agree([t for n in names for t in times[n]])
  for i, n in enumerate(names):
    times[n] = flat[i * rounds:(i + 1) * rounds]
  result = {}
  for n in names:
    entry = {"median_ms": median(times[n]), "rounds_ms": [round(t, 5) for t in times[n]],
             "iters": iters[n]}
    if floor in times:
      ratios = [a / b for a, b in zip(times[n], times[floor])]
      entry["over_floor"] = median(ratios)
      entry["ratios"] = [round(x, 4) for x in ratios]
    result[n] = entry
  return result
