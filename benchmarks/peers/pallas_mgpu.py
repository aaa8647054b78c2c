#!/usr/bin/env python3
"""Peer: jax's Pallas Mosaic GPU `all_gather_lhs_matmul`
(jax.experimental.pallas.ops.gpu.collective_matmul_mgpu), one process per GPU
through jax.distributed on 127.0.0.1, beside its own dot-only floor, with the
timing method of bench.py (harness.time_interleaved). Per shape it keeps the
fastest of a few tile configurations (the same on every process).

  python3 benchmarks/peers/pallas_mgpu.py --out X.json [--quick] [--budget S]
      [--profile 4096x4096x4096 --profile-dir DIR]

--profile SHAPE (repeatable): after that shape's timings, every process traces
the kernel's best config, back to back (jax.profiler, annotation
"bench_back_to_back"), into DIR/<op>_<shape>_p<i>/ (benchmarks/trace_summary.py
reads it).

launches the processes itself (CUDA_VISIBLE_DEVICES=i each). It needs NCCL >=
2.29 for its symmetric windows (docs/gpu-testing.md, "The machine"). Every failure
becomes an "error" entry in the JSON; the launcher exits 0 once a JSON exists.

Longer than 300 lines because the peer launches its own processes and searches tile configs; it stands alone so that it needs nothing of the project.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import harness  # noqa: E402
from harness import parse_shape, say, shape_str, short_error  # noqa: E402
from bench import PEER_AG_OPS, add_sweep_copies  # noqa: E402

PART = "pallas_mgpu"
OPS = PEER_AG_OPS
WEIGHTS = {"all_gather_matmul": 65, "all_gather_matmul_sweep": 35}
# (tile_m, grid_minor_dim, grid_tile_width), in the order they are tried.
CONFIG_ORDER = ((128, "M", 8), (256, "N", 8), (256, "M", 8), (128, "N", 8),
                (128, "M", 4), (256, "N", 4), (256, "M", 4), (128, "N", 4))


def parse_args():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--budget", type=float, default=150.0)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--ops", default=",".join(OPS))
  p.add_argument("--shapes")
  p.add_argument("--configs", type=int, default=0, help="tile configs to try per shape "
                 "(default 4, quick 2)")
  p.add_argument("--rounds", type=int)
  p.add_argument("--warmup-s", type=float)
  p.add_argument("--warmup-first-s", type=float)
  p.add_argument("--hang-timeout", type=float, default=90.0)
  p.add_argument("--resume", action="store_true", help="keep --out's shapes; skip those that hung")
  p.add_argument("--profile", action="append", default=[], metavar="SHAPE",
                 help="trace the best config at this shape (repeatable)")
  p.add_argument("--profile-dir", default="/tmp/jcg_pallas_profiles")
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--coordinator")
  p.add_argument("--process-id", type=int)
  a = p.parse_args()
  a.configs = a.configs or (2 if a.quick else 4)
  a.rounds = a.rounds or (6 if a.quick else 8)
  a.warmup_s = a.warmup_s if a.warmup_s is not None else (1.5 if a.quick else 2.0)
  a.warmup_first_s = a.warmup_first_s if a.warmup_first_s is not None else (4.0 if a.quick else 6.0)
  return a


def launch(args) -> int:
  """Starts one process per GPU; once more (--resume) after a hang, if time is left."""
  t0 = time.time()
  argv = [a for a in sys.argv[1:] if a != "--resume"]
  i_budget = argv.index("--budget") if "--budget" in argv else None
  resume = args.resume
  for attempt in range(2):
    left = args.budget - (time.time() - t0)
    if attempt and left < 40:
      break
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    run_argv = list(argv)
    if i_budget is not None:
      run_argv[i_budget + 1] = f"{left:.0f}"
    else:
      run_argv += ["--budget", f"{left:.0f}"]
    if resume:
      run_argv.append("--resume")
    procs = []
    for i in range(args.processes):
      env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
      procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *run_argv,
                                     "--coordinator", f"127.0.0.1:{port}", "--process-id", str(i)],
                                    env=env))
    rcs = []
    for p in procs:
      try:
        rcs.append(p.wait(timeout=max(30.0, left + 20)))
      except subprocess.TimeoutExpired:
        p.kill()
        rcs.append(124)
    say(f"{PART}: processes exited with {rcs}")
    try:
      with open(args.out) as f:
        data = json.load(f)
    except Exception:  # noqa: BLE001
      break
    if data.get("finished") or not data.get("hangs"):
      break
    resume = True
  if not os.path.exists(args.out):
    harness.write_json(args.out, {"part": PART, "schema": 1, "records": [], "finished": False,
                                  "error": f"no output; process exit codes {rcs}"})
  else:
    try:
      with open(args.out) as f:
        data = json.load(f)
      if any(rcs) and not data.get("finished"):
        data["error"] = data.get("error") or f"process exit codes {rcs}"
        harness.write_json(args.out, data)
    except Exception:  # noqa: BLE001
      pass
  return 0


def child(args) -> int:
  t_start = time.time()
  pid = args.process_id
  main_proc = pid == 0
  result = {"part": PART, "schema": 1, "argv": sys.argv, "finished": False, "records": [],
            "machine": harness.machine_facts() if main_proc else {},
            "method": {"rounds": args.rounds, "warmup_s": args.warmup_s, "quick": args.quick,
                       "configs": args.configs, "budget_s": args.budget}}

  def save():
    if main_proc:
      result["elapsed_s"] = round(time.time() - t_start, 1)
      harness.write_json(args.out, result)

  state = {"op": None, "shape": None}

  def on_hang(what):
    result.setdefault("hangs", []).append(dict(state, what=what))
    save()

  watchdog = harness.Watchdog(args.hang_timeout, on_hang)
  try:
    import jax  # noqa: PLC0415
    jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=pid)
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # noqa: PLC0415
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415
    result["versions"] = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    mesh = jax.make_mesh((args.processes,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    jax.set_mesh(mesh)
  except Exception as e:  # noqa: BLE001
    result["error"] = "start: " + short_error(e, 600)
    save()
    say(f"[p{pid}] {result['error']}")
    watchdog.stop()
    return 2

  def agree_max(values):
    arr = multihost_utils.process_allgather(np.asarray(list(values), dtype=np.float64))
    return [float(v) for v in np.max(np.asarray(arr).reshape(args.processes, -1), axis=0)]

  def decide(flag):
    return bool(multihost_utils.broadcast_one_to_all(np.int32(1 if flag else 0)))

  def tick(phase, variant=None):
    watchdog.tick(f"{state['op']} {state['shape']} {phase} {variant or ''}")

  counter = [0]

  def rand(shape, spec, scale=1.0):
    counter[0] += 1
    key = jax.random.fold_in(jax.random.key(7), counter[0])
    f = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16),
                out_shardings=NamedSharding(mesh, spec))
    return f(key)

  dim = {"M": hm.MatmulDimension.M, "N": hm.MatmulDimension.N}
  configs = [hm.TuningConfig(tile_m=tm, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=dim[gd], grid_tile_width=gw,
                             wg_dimension=hm.MatmulDimension.N)
             for tm, gd, gw in CONFIG_ORDER[: args.configs]]

  def kernel(cfg):
    return jax.jit(jax.shard_map(
        lambda a, b: cm.all_gather_lhs_matmul(a, b, "x", config=cfg, dtype=jnp.bfloat16),
        out_specs=P(None, "x"), check_vma=False))

  floor_fn = jax.jit(jax.shard_map(lambda a, b: a @ b, out_specs=P(None, "x"), check_vma=False))
  xla_fn = jax.jit(jax.shard_map(lambda a, b: jax.lax.all_gather(a, "x", axis=0, tiled=True) @ b,
                                 out_specs=P(None, "x"), check_vma=False))
  relerr = jax.jit(lambda a, b: jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                   / jnp.maximum(jnp.linalg.norm(b.astype(jnp.float32).ravel()), 1e-30))

  def trace(name, f, fargs, calls=5):
    """A back-to-back trace of `calls` calls in every process; never raises.
    The processes agree that each one's trace started before any collective."""
    folder = os.path.join(args.profile_dir, f"{name}_p{pid}")
    error = None
    try:
      jax.profiler.start_trace(folder, create_perfetto_trace=True)
    except Exception as e:  # noqa: BLE001
      error = short_error(e, 200)
    if agree_max([1.0 if error else 0.0])[0]:
      if error is None:
        jax.profiler.stop_trace()
      return {"error": error or "a peer could not start its trace"}
    try:
      with jax.profiler.TraceAnnotation("bench_back_to_back"):
        out = None
        for _ in range(calls):
          out = f(*fargs)
        jax.block_until_ready(out)
    finally:
      jax.profiler.stop_trace()
    return {"dir": folder}

  skip = harness.resume_from(args.out, result) if args.resume else set()
  ops = [o for o in args.ops.split(",") if o in OPS]
  budget = harness.Budget(args.budget - (time.time() - t_start), {o: WEIGHTS[o] for o in ops})
  first = True
  for op in ops:
    share = budget.start(op)
    full, quick = OPS[op]
    shapes = [parse_shape(s) for s in args.shapes.split(",")] if args.shapes else (
        quick if args.quick else full)
    if main_proc:
      say(f"== {PART} {op}: {len(shapes)} shapes, {len(configs)} configs; budget {share:.0f} s")
    spent = []
    for shape in shapes:
      n, k, m = shape
      state.update(op=op, shape=shape_str(shape))
      if (op, shape_str(shape)) in skip:
        continue
      rec = {"op": op, "shape": list(shape), "shape_str": shape_str(shape),
             "floor_variant": "floor", "variants": {}}
      estimate = max(spent) if spent else len(configs) * 4 + args.warmup_s + args.rounds * 0.15
      if not decide(budget.fits(estimate)):
        result["records"].append({"op": op, "shape": list(shape), "shape_str": shape_str(shape),
                                  "skipped": f"budget (needs ~{estimate:.0f} s)"})
        save()
        continue
      t0 = time.time()
      try:
        tick("data")
        x = rand((n, k), P("x", None))
        xg = rand((n, k), P(None, None))
        w = rand((k, m), P(None, "x"), k ** -0.5)
        tried = []
        best = None
        for i, cfg in enumerate(configs):
          left = len(shapes) - shapes.index(shape)  # this shape and those after it
          if i and not decide(budget.part_left() > left * (args.rounds * 0.2 + 8)):
            break  # keep time for the shapes after this one
          tick("tune", str(i))
          label = f"tile_m={cfg.tile_m} grid_minor={cfg.grid_minor_dim.name} width={cfg.grid_tile_width}"
          ok, dt = 1.0, 0.0
          try:
            f = kernel(cfg)
            jax.block_until_ready(f(x, w))
            t = time.perf_counter()
            for _ in range(10):
              r = f(x, w)
            jax.block_until_ready(r)
            dt = (time.perf_counter() - t) / 10 * 1e3
          except Exception as e:  # noqa: BLE001
            ok, f = 0.0, None
            tried.append({"config": label, "error": short_error(e, 200)})
          bad, dt = agree_max([1.0 - ok, dt])
          if not bad:
            tried.append({"config": label, "ms_cold": round(dt, 4)})
            if best is None or dt < best[0]:
              best = (dt, f, label)
        rec["configs"] = tried
        fns, fargs = {"floor": floor_fn}, {"floor": (xg, w)}
        if best is None:
          rec["variants"]["pallas_mgpu"] = {"error": "no tile config ran: " + "; ".join(
              str(t.get("error"))[:120] for t in tried[:2])}
        else:
          fns["pallas_mgpu"], fargs["pallas_mgpu"] = best[1], (x, w)
          rec["best_config"] = best[2]
          try:
            rec["rel_err_reference"] = "xla"
            rec["variants"]["pallas_mgpu"] = {
                "rel_err": float(f"{float(relerr(best[1](x, w), xla_fn(x, w))):.3g}")}
          except Exception as e:  # noqa: BLE001
            rec["variants"]["pallas_mgpu"] = {"rel_err_error": short_error(e, 200)}
        jax.block_until_ready(floor_fn(xg, w))
        warm_state = {}

        def on_warm():
          if main_proc:  # read while the timed rounds run
            warm_state["s"] = harness.gpu_state_async()

        timings = harness.time_interleaved(
            fns, fargs, floor="floor", rounds=args.rounds, target_ms=30.0,
            warmup_s=args.warmup_first_s if first else args.warmup_s, agree_max=agree_max,
            tick=tick, on_warm=on_warm)
        first = False
        for name, t in timings.items():
          rec["variants"].setdefault(name, {}).update(t)
        if shape_str(shape) in args.profile and "pallas_mgpu" in fns:
          tick("profile")
          rec["profile"] = trace(f"{op}_{shape_str(shape)}", fns["pallas_mgpu"], (x, w))
        if main_proc:
          rec["gpu_state_warm"] = warm_state["s"]() if "s" in warm_state else []
          rec["gpu_state_end"] = harness.gpu_state()
      except Exception as e:  # noqa: BLE001
        rec["error"] = short_error(e, 600)
      rec["elapsed_s"] = round(time.time() - t0, 1)
      spent.append(time.time() - t0)
      result["records"].append(rec)
      save()
      if main_proc:
        v = rec["variants"].get("pallas_mgpu", {})
        fl = rec["variants"].get("floor", {})
        say(f"{PART} {op} {shape_str(shape)}: "
            + (f"pallas_mgpu {v['median_ms']:.3f} ms ({v.get('over_floor', float('nan')):.3f}) "
               f"floor {fl.get('median_ms', float('nan')):.3f} ms [{rec.get('best_config')}]"
               if "median_ms" in v else f"ERR {v.get('error') or rec.get('error')}")
            + f" | {harness.gpu_state_str(rec.get('gpu_state_warm') or rec.get('gpu_state_end', []))}")
  watchdog.stop()
  add_sweep_copies(result)
  result["finished"] = True
  save()
  return 0


def main():
  args = parse_args()
  if args.process_id is None:
    return launch(args)
  return child(args)


if __name__ == "__main__":
  sys.exit(main())
