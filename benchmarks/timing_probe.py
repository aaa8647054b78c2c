"""Why autotune and the benchmark rank the AllGather+GEMMs differently.

Autotune once timed the ring ahead of cuBLASMp `default` at
16384x8192x8192 and `split_p2p` ahead of `default` at 4096^3, while the
benchmark, in the same process, had `default` ahead at both (so `auto` ran 7-12%
slower than it could). Two things differ: the programs (autotune's call the
backend directly; the benchmark's go through the public API) and the timing
(autotune: a fixed count of calls per batch from the problem's FLOPs, up to 200;
the benchmark: a count calibrated from one synchronised call, about 30 ms a
batch, rounds alternating in order). This probe times both programs both ways,
interleaved, in one process driving every GPU, and prints one table per shape.
`--op rs` does the same for the GEMM+ReduceScatter (autotune once timed
`pipelined_ce` at 0.251 ms at 8192x4096x4096 and the benchmark at 0.42).
docs/design.md#backendauto-and-autotuning has what came of it.

  python3 benchmarks/timing_probe.py [--op ag|rs] [--shapes 4096x4096x4096,...]
  (on a machine set up as docs/gpu-testing.md says)
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import harness  # noqa: E402

NAMES = ("ring", "cublasmp_default", "cublasmp_split_p2p", "pipelined_ce", "xla")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--op", choices=("ag", "rs"), default="ag")
  p.add_argument("--shapes", default="16384x8192x8192,4096x4096x4096")
  p.add_argument("--seconds", type=float, default=0.6, help="autotune's seconds_per_problem")
  args = p.parse_args()

  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  jcg = bench.import_jcg()
  from jax_comm_gemm.backends import routes as auto, tuning  # noqa: PLC0415

  mesh = Mesh(np.asarray(jax.devices()), (bench.AXIS,))
  jcg.connect(mesh, axis_name=bench.AXIS)
  size = mesh.shape[bench.AXIS]
  ctx = bench.Ctx(jax, mesh, seed=7)
  for text in args.shapes.split(","):
    n, k, m = (int(v) for v in text.split("x"))
    if args.op == "ag":  # x [n, k] gathered over rows, w [k, m] split over columns
      problem = auto.Problem(auto.AG, n // size, k, m // size, "bfloat16", False, size)
      build = bench.build_all_gather_matmul
    else:  # x [n, k] and w [k, m] split over k
      problem = auto.Problem(auto.RS, n, k // size, m, "bfloat16", False, size)
      build = bench.build_matmul_reduce_scatter
    tuner = {name: run for name, run in tuning._runnables(mesh, bench.AXIS, problem,
                                                          args.seconds,
                                                          jcg.runtime.REGISTRY.plan()).items() if name in NAMES}
    fns, fn_args = build(ctx, (n, k, m), list(NAMES) + ["floor"])
    for name, (call, _) in tuner.items():
      jax.block_until_ready(call())
    for name in fns:
      jax.block_until_ready(fns[name](*fn_args[name]))
    # The benchmark's calibrated count, for autotune's timing of the same programs.
    calibrated = harness.time_interleaved({n_: c for n_, (c, _) in tuner.items()},
                                          {n_: () for n_ in tuner}, floor=None, rounds=1,
                                          warmup_s=0.5)
    rows = {
        "autotune programs, autotune timing": tuning.time_candidates(
            tuner, rounds=10, warmup_rounds=tuning.WARMUP_ROUNDS),
        "autotune programs, autotune timing, bench's count": tuning.time_candidates(
            {n_: (c, calibrated[n_]["iters"]) for n_, (c, _) in tuner.items()},
            rounds=10, warmup_rounds=tuning.WARMUP_ROUNDS),
        "autotune programs, bench timing": {
            n_: t["median_ms"] / 1e3 for n_, t in harness.time_interleaved(
                {n_: c for n_, (c, _) in tuner.items()}, {n_: () for n_ in tuner},
                floor=None, warmup_s=2.0).items()},
        "bench programs, bench timing": {
            n_: t["median_ms"] / 1e3 for n_, t in harness.time_interleaved(
                fns, fn_args, floor="floor", warmup_s=2.0).items()},
    }
    counts = {n_: (it, calibrated[n_]["iters"]) for n_, (_, it) in tuner.items()}
    print(f"== {args.op} {text} (ms per call; calls per batch autotune/bench: {counts})", flush=True)
    print(f"  {'':52s}" + "".join(f"{n_:>20s}" for n_ in NAMES))
    for label, times in rows.items():
      print(f"  {label:52s}" + "".join(f"{times.get(n_, float('nan')) * 1e3:20.3f}"
                                        for n_ in NAMES), flush=True)
    print("  gpu:", harness.gpu_state(), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
