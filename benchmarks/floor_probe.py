"""What the MLP benchmark's floor holds besides its six GEMMs, on one GPU.

bench.py's MLP floor is the forward + backward of ``gelu(x @ w1) @ w2`` on
tokens that are already gathered: the step with nothing to communicate. It
therefore holds the activation's element-wise work as well as the GEMMs. This
probe times, per MLP shape at TP 2 (a rank's ffn is half), interleaved at
steady state (harness.time_interleaved), three programs on one GPU:

  floor     bench.py's floor, as it is there
  identity  the same step without the activation
  gemms     the six GEMMs alone, written out (h, y, dh, dw2, dx, dw1)

and reports each over ``gemms``. With --profile it also traces a few floor
steps at the first shape and splits the device's time by kind of work
(trace_summary.py), so that "where the step's time goes over its GEMMs" comes
from a profile.

  python3 benchmarks/floor_probe.py [--shapes 8192x8192x28672,...] [--profile DIR] \\
      [--json OUT]    (on a machine set up as docs/gpu-testing.md says)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import harness  # noqa: E402
import trace_summary  # noqa: E402

MLP_SHAPES = "8192x8192x28672,16384x4096x16384,8192x8192x7168,4096x4096x16384"
TP = 2


def programs(jax):
  """name -> (x, w1, w2, ct) -> outputs, each jitted."""
  def gemms(x, w1, w2, ct):
    h = x @ w1
    dh = ct @ w2.T
    return h @ w2, dh @ w1.T, x.T @ dh, h.T @ ct

  return {"floor": jax.jit(bench.vjp_step(jax, partial(bench.floor_mlp, jax))),
          "identity": jax.jit(bench.vjp_step(jax, lambda x, w1, w2: (x @ w1) @ w2)),
          "gemms": jax.jit(gemms)}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default=MLP_SHAPES, help="tokens x d x ffn, comma list")
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--warmup-s", type=float, default=4.0)
  p.add_argument("--profile", help="trace a few floor steps at the first shape into DIR")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args()

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  facts = {**harness.machine_facts(), "jax": jax.__version__,
           "device": jax.devices()[0].device_kind}
  harness.say(json.dumps(facts))
  fns = programs(jax)
  rows, first = [], None
  for i, text in enumerate(args.shapes.split(",")):
    n, d, f = harness.parse_shape(text)
    keys = jax.random.split(jax.random.key(i), 4)
    x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (d, f // TP), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (f // TP, d), jnp.float32)
          * (f // TP) ** -0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(keys[3], (n, d), jnp.bfloat16)
    inputs = (x, w1, w2, ct)
    first = first or inputs
    # What XLA made of each: its fusions and its GEMM custom calls.
    kinds = {}
    for name, fn in fns.items():
      hlo = fn.lower(*inputs).compile().as_text()
      kinds[name] = {"gemm_calls": hlo.count("custom_call_target=\"__cublas"),
                     "fusions": hlo.count(" fusion(")}
      jax.block_until_ready(fn(*inputs))
    timed = harness.time_interleaved(fns, {name: inputs for name in fns}, floor="gemms",
                                     rounds=args.rounds, warmup_s=args.warmup_s,
                                     target_ms=100.0)
    clocks = harness.gpu_state()
    row = {"shape": text, "local": [n, d, f // TP], "programs": kinds,
           "median_ms": {k: round(v["median_ms"], 4) for k, v in timed.items()},
           "over_gemms": {k: round(v["over_floor"], 4) for k, v in timed.items()},
           "clocks": clocks}
    rows.append(row)
    harness.say(f"{text} (rank's ffn {f // TP}): " + "  ".join(
        f"{k} {row['median_ms'][k]:.3f} ms ({row['over_gemms'][k]:.4f})" for k in fns)
        + f" | {harness.gpu_state_str(clocks)}")

  profile = None
  if args.profile:
    floor = fns["floor"]
    for _ in range(20):  # warm, so that the traced steps run at the held clock
      out = floor(*first)
    jax.block_until_ready(out)
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      for _ in range(3):
        out = floor(*first)
      jax.block_until_ready(out)
    profile = trace_summary.summarize(trace_summary.load(trace_summary.find_trace(args.profile)))
    print(trace_summary.format_summary(profile, "floor, 3 steps"))

  harness.write_json(args.json, {"facts": facts, "rows": rows, "profile": profile})
  return 0


if __name__ == "__main__":
  sys.exit(main())
