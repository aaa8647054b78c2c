"""Where the fused calls' GPU work runs, per fence (issue 8, "the race
explained"): one process drives both GPUs through the bf16 MLP step of the
stress check (checks.mlp_step), traced with jax.profiler, and prints for GPU 0
each stream's share of the step and a timeline of the events around the fused
calls: which stream each kernel and copy ran on, when it started and ended.

  python3 tests/gpu/race_trace.py OUT_DIR [--fences none,own_stream]

Each fence runs in a process of its own (the fence is fixed at connect).
Writes OUT_DIR/race_trace_<fence>.txt and prints them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

STEPS = 3      # traced steps; the timeline shows the middle one
LINES = 160    # timeline rows printed per step


def trace_one(out_dir: str, fence: str) -> None:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  import checks  # noqa: PLC0415
  import jax_comm_gemm as jcg  # noqa: PLC0415
  import trace_summary  # noqa: PLC0415

  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  jcg.connect(mesh, "tp")
  n, d, f = 1024, 512, 1024
  hosts = [checks.random(5, n, d), checks.random(6, d, f, scale=d**-0.5),
           checks.random(7, f, d, scale=f**-0.5), checks.random(8, n, d)]
  args = [checks.put(mesh, a, s, checks.DTYPES["bf16"]) for a, s in zip(hosts, checks.MLP_IN_SPECS)]
  step = checks.mlp_step(mesh)
  for _ in range(5):
    jax.block_until_ready(step(*args))
  trace_dir = os.path.join(out_dir, f"trace_{fence}")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(STEPS):
      with jax.profiler.TraceAnnotation(f"race_step_{i}"):
        jax.block_until_ready(step(*args))
  trace = trace_summary.load(trace_dir)
  mark = f"race_step_{STEPS // 2}"
  lines = [f"fence {fence}", trace_summary.format_summary(trace_summary.summarize(trace, mark))]
  window = trace_summary.resolve_window(trace, mark)
  lines += timeline(trace, window[:2] if window else None)
  text = "\n".join(lines)
  with open(os.path.join(out_dir, f"race_trace_{fence}.txt"), "w") as f:
    f.write(text + "\n")
  print(text, flush=True)


def timeline(trace, window) -> list[str]:
  """GPU 0's events in `window` (or the middle third of the trace), by start."""
  import trace_summary  # noqa: PLC0415

  events = trace["events"]
  gpu0 = [p for p, name in trace["pname"].items()
          if (m := trace_summary.DEVICE_RE.search(name)) and m.group(2) == "0"]
  rows = [e for e in events if e[0] in gpu0
          and trace["tname"].get((e[0], e[1]), "") not in trace_summary.DERIVED_LINES]
  if not rows:
    return ["no GPU 0 events in the trace"]
  if window is None:
    t0, t1 = min(e[2] for e in rows), max(e[2] + e[3] for e in rows)
    third = (t1 - t0) / 3
    window = (t0 + third, t1 - third)
  lo, hi = window
  rows = sorted((e for e in rows if e[2] + e[3] > lo and e[2] < hi), key=lambda e: e[2])
  out = [f"GPU 0, {len(rows)} events in {hi - lo:.0f} us; start/end in us from the window"]
  busy = {}
  for e in rows:
    busy[e[1]] = busy.get(e[1], 0.0) + e[3]
  for tid, us in sorted(busy.items(), key=lambda kv: -kv[1]):
    out.append(f"  stream {tid} ({trace['tname'].get((rows[0][0], tid), '?')}): {us:.0f} us busy")
  for pid, tid, ts, dur, name in rows[:LINES]:
    out.append(f"  {ts - lo:9.1f} {ts + dur - lo:9.1f}  s{tid:<4} {name[:90]}")
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("out_dir")
  p.add_argument("--fences", default="none,own_stream")
  p.add_argument("--one", help=argparse.SUPPRESS)
  a = p.parse_args()
  os.makedirs(a.out_dir, exist_ok=True)
  if a.one:
    trace_one(a.out_dir, a.one)
    return
  for fence in a.fences.split(","):
    env = dict(os.environ, JAX_COMM_GEMM_FENCE=fence, JAX_COMM_GEMM_ALLOW_UNSAFE_FENCE="1")
    rc = subprocess.run([sys.executable, __file__, a.out_dir, "--one", fence], env=env,
                        timeout=120).returncode
    print(f"race trace {fence}: rc={rc}", flush=True)


if __name__ == "__main__":
  main()
