#!/usr/bin/env python3
"""Where two jax.profiler traces of the same program differ: GPU time per kernel
kind (an XLA kernel's name without its numeric suffix: ``loop_convert_fusion_12``
counts as ``loop_convert_fusion``), A against B, largest differences first.

  python3 benchmarks/kernel_diff.py TRACE_OR_DIR_A TRACE_OR_DIR_B [--window NAME] [--top 25]

--window NAME keeps the GPU events inside the host annotations named NAME (as
trace_summary.py's window; the example's --profile marks "train_step").
Needs only the standard library (and trace_summary.py beside it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_summary  # noqa: E402


def kind(name: str) -> str:
  return re.sub(r"([._]\d+)+$", "", name)


def per_kind(path: str, window: str | None) -> dict:
  trace = trace_summary.load(path)
  gpu = {pid for pid, n in trace["pname"].items() if "GPU" in n or "gpu" in n}
  spans = [(ts, ts + dur) for pid, _, ts, dur, name in trace["events"]
           if window and pid not in gpu and name.startswith(window)]
  out = collections.defaultdict(lambda: [0.0, 0])
  for pid, _, ts, dur, name in trace["events"]:
    if pid not in gpu or (spans and not any(a <= ts < b for a, b in spans)):
      continue
    out[kind(name)][0] += dur
    out[kind(name)][1] += 1
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("a")
  p.add_argument("b")
  p.add_argument("--window")
  p.add_argument("--top", type=int, default=25)
  args = p.parse_args(argv)
  a, b = per_kind(args.a, args.window), per_kind(args.b, args.window)
  total_a, total_b = sum(v[0] for v in a.values()), sum(v[0] for v in b.values())
  print(f"GPU time: A {total_a / 1e3:.1f} ms, B {total_b / 1e3:.1f} ms, "
        f"A - B {(total_a - total_b) / 1e3:+.1f} ms")
  print("| kernel kind | A ms (count) | B ms (count) | A - B ms |\n| --- | --- | --- | --- |")
  names = sorted(set(a) | set(b), key=lambda n: -abs(a[n][0] - b[n][0]))
  for n in names[:args.top]:
    print(f"| {n[:90]} | {a[n][0] / 1e3:.2f} ({a[n][1]}) | {b[n][0] / 1e3:.2f} ({b[n][1]}) | "
          f"{(a[n][0] - b[n][0]) / 1e3:+.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
