#!/usr/bin/env python3
"""Peer: PyTorch SymmetricMemory's fused AllGather+GEMM and GEMM+ReduceScatter
(`torch.ops.symm_mem.fused_all_gather_matmul`, `fused_matmul_reduce_scatter`),
beside NCCL-then-matmul and its own matmul-only floor, with the timing method of
bench.py (harness.time_interleaved: load first, interleaved rounds, medians of
per-round ratios to the floor; the slowest rank's time per round).

  torchrun --nproc-per-node 2 benchmarks/peers/torch_symm_mem.py --out X.json [--quick]
      [--profile all_gather_matmul:16384x8192x8192 --profile-dir DIR]

--profile OP:SHAPE (repeatable), after the timings: every rank records a
torch.profiler trace of --profile-steps calls of each variant (torch_symm_mem,
torch_nccl, floor), each call in record_function("bench_step_<i>") and ended by a
synchronize, then as many back to back in "bench_back_to_back", into DIR/<op>_<shape>_<variant>_rank<r>.trace.json.gz (Chrome trace,
gzipped; benchmarks/trace_summary.py reads it).

NVLink multicast stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (docs/gpu-testing.md,
"The machine"; this script refuses to run without it). Every failure becomes an
"error" entry in the JSON; the script exits 0 unless it could not start.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import harness  # noqa: E402
from harness import parse_shape, say, shape_str, short_error  # noqa: E402
from bench import PEER_AG_OPS, RS_QUICK, RS_SHAPES, add_sweep_copies  # noqa: E402

PART = "torch_symm_mem"
OPS = {**PEER_AG_OPS, "matmul_reduce_scatter": (RS_SHAPES, RS_QUICK)}
WEIGHTS = {"all_gather_matmul": 45, "all_gather_matmul_sweep": 25, "matmul_reduce_scatter": 30}


def parse_args():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--budget", type=float, default=120.0)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--ops", default=",".join(OPS))
  p.add_argument("--shapes", help="only these shapes")
  p.add_argument("--rounds", type=int)
  p.add_argument("--warmup-s", type=float)
  p.add_argument("--warmup-first-s", type=float)
  p.add_argument("--hang-timeout", type=float, default=90.0)
  p.add_argument("--resume", action="store_true", help="keep --out's shapes; skip those that hung")
  p.add_argument("--profile", action="append", default=[], metavar="OP:SHAPE",
                 help="a torch.profiler trace of each variant of this shape (repeatable)")
  p.add_argument("--profile-dir", default="/tmp/jcg_torch_profiles")
  p.add_argument("--profile-steps", type=int, default=3)
  p.add_argument("--profile-warmup", type=int, default=10, help="calls before each trace")
  a = p.parse_args()
  a.rounds = a.rounds or (6 if a.quick else 8)
  a.warmup_s = a.warmup_s if a.warmup_s is not None else (1.5 if a.quick else 2.0)
  a.warmup_first_s = a.warmup_first_s if a.warmup_first_s is not None else (4.0 if a.quick else 6.0)
  return a


def main():
  args = parse_args()
  t_start = time.time()
  rank = int(os.environ.get("RANK", "-1"))
  result = {"part": PART, "schema": 1, "argv": sys.argv, "finished": False, "records": [],
            "machine": harness.machine_facts() if rank <= 0 else {}, "versions": {},
            "method": {"rounds": args.rounds, "warmup_s": args.warmup_s, "quick": args.quick,
                       "budget_s": args.budget, "timing": "host wall time of back-to-back "
                       "calls ended by torch.cuda.synchronize, after a barrier"}}
  main_rank = rank <= 0

  def save():
    if main_rank:
      result["elapsed_s"] = round(time.time() - t_start, 1)
      harness.write_json(args.out, result)

  if rank < 0:
    result["error"] = "not started by torchrun (no RANK in the environment)"
    save()
    return 2
  if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
    result["error"] = "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is not set: refusing (NVLink multicast)"
    save()
    say(result["error"])
    return 2
  try:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    try:
      dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    except TypeError:
      dist.init_process_group("nccl")
    world = dist.get_world_size()
    group = dist.group.WORLD
    group_name = group.group_name
    result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                          if hasattr(torch.cuda, "nccl") else None}
    try:
      from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: PLC0415
      enable_symm_mem_for_group(group_name)
    except Exception as e:  # noqa: BLE001  (newer torch enables it by itself)
      result["symm_mem_enable"] = short_error(e, 200)
  except Exception as e:  # noqa: BLE001
    result["error"] = "start: " + short_error(e, 600)
    save()
    say(result["error"])
    return 2

  dev = torch.device("cuda", torch.cuda.current_device())
  state = {"op": None, "shape": None}

  def on_hang(what):
    result.setdefault("hangs", []).append(dict(state, what=what))
    save()

  watchdog = harness.Watchdog(args.hang_timeout, on_hang)

  def tick(phase, variant=None):
    watchdog.tick(f"{state['op']} {state['shape']} {phase} {variant or ''}")

  def agree_max(values):
    t = torch.tensor(list(values), dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]

  def decide(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.broadcast(t, src=0)
    return bool(t.item())

  def align():
    dist.barrier()
    torch.cuda.synchronize()

  def sync(_out):
    torch.cuda.synchronize()

  gen = torch.Generator(device=dev)

  def randn(shape, seed, scale=1.0):
    gen.manual_seed(seed)
    return (torch.randn(shape, device=dev, dtype=torch.float32, generator=gen) * scale).to(
        torch.bfloat16)

  def build(op, shape):
    n, k, m = shape
    seed = zlib.crc32(f"{op} {shape}".encode()) % (2**30) + 1000 * rank
    fns = {}
    if op.startswith("all_gather_matmul"):
      a = randn((n // world, k), seed)
      ag = randn((n, k), seed + 1)
      b = randn((k, m // world), seed + 2, k ** -0.5)
      buf = torch.empty((n, k), device=dev, dtype=torch.bfloat16)

      def fused(a, b):
        return torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)[1][0]

      def nccl(a, b):
        dist.all_gather_into_tensor(buf, a)
        return buf @ b

      fns = {"torch_symm_mem": (fused, (a, b)), "torch_nccl": (nccl, (a, b)),
             "floor": (lambda x, y: x @ y, (ag, b))}
    else:
      a = randn((n, k // world), seed)
      b = randn((k // world, m), seed + 2, k ** -0.5)
      out = torch.empty((n // world, m), device=dev, dtype=torch.bfloat16)

      def fused(a, b):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

      def nccl(a, b):
        dist.reduce_scatter_tensor(out, a @ b)
        return out

      fns = {"torch_symm_mem": (fused, (a, b)), "torch_nccl": (nccl, (a, b)),
             "floor": (lambda x, y: x @ y, (a, b))}
    return fns

  def run_profile(item):
    """Traces every variant of one OP:SHAPE on this rank; never raises."""
    op, _, text = item.partition(":")
    entry = {"profile": item, "variants": {}}
    t0 = time.time()
    try:
      shape = parse_shape(text)
      state.update(op=op, shape=shape_str(shape))
      if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
      from torch import profiler  # noqa: PLC0415
      tick("profile build")
      fns = build(op, shape)
      os.makedirs(args.profile_dir, exist_ok=True)
      acts = [profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.CUDA]
      for name, (f, a) in fns.items():
        tick("profile", name)
        path = os.path.join(args.profile_dir,
                            f"{op}_{shape_str(shape)}_{name}_rank{rank}.trace.json.gz")
        try:
          for _ in range(args.profile_warmup):
            f(*a)
          with profiler.profile(activities=acts) as prof:
            align()  # both ranks enter step 0 together
            for i in range(args.profile_steps):
              with profiler.record_function(f"bench_step_{i}"):
                f(*a)
                torch.cuda.synchronize()
            # As the timings run: back to back, one wait at the end.
            with profiler.record_function("bench_back_to_back"):
              for _ in range(args.profile_steps):
                f(*a)
              torch.cuda.synchronize()
          prof.export_chrome_trace(path[:-3])
          with open(path[:-3], "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
          os.remove(path[:-3])
          entry["variants"][name] = {"trace": path}
        except Exception as e:  # noqa: BLE001
          entry["variants"][name] = {"error": short_error(e)}
          say(f"rank {rank}: profile {item} {name}: FAILED {short_error(e)}")
      del fns
    except Exception as e:  # noqa: BLE001
      entry["error"] = short_error(e, 600)
      say(f"rank {rank}: profile {item}: FAILED {entry['error']}")
    entry["elapsed_s"] = round(time.time() - t0, 1)
    torch.cuda.empty_cache()
    return entry

  skip = harness.resume_from(args.out, result) if args.resume else set()
  weights = {o: WEIGHTS.get(o, 20) for o in args.ops.split(",") if o in OPS}
  if args.profile:
    weights["profile"] = 8 * len(args.profile)
  budget = harness.Budget(args.budget - (time.time() - t_start), weights)
  first = True
  for op in [o for o in args.ops.split(",") if o in OPS]:
    share = budget.start(op)
    full, quick = OPS[op]
    shapes = quick if args.quick else full
    if args.shapes:
      shapes = [parse_shape(s) for s in args.shapes.split(",")]
    if main_rank:
      say(f"== {PART} {op}: {len(shapes)} shapes; budget {share:.0f} s")
    spent = []
    for shape in shapes:
      state.update(op=op, shape=shape_str(shape))
      if (op, shape_str(shape)) in skip:
        continue
      rec = {"op": op, "shape": list(shape), "shape_str": shape_str(shape),
             "floor_variant": "floor", "variants": {}}
      guess = 3 * (0.5 + args.rounds * 0.045 * 1.3) + args.warmup_s + 2
      estimate = max(spent) if spent else guess
      if not decide(budget.fits(estimate)):
        rec = {k: rec[k] for k in ("op", "shape", "shape_str")}
        rec["skipped"] = f"budget (needs ~{estimate:.0f} s, {budget.part_left():.0f} s left)"
        result["records"].append(rec)
        save()
        continue
      t0 = time.time()
      try:
        tick("build")
        fns = build(op, shape)
        outs, ok = {}, []
        for name, (f, a) in fns.items():
          tick("first call", name)
          try:
            outs[name] = f(*a)
            torch.cuda.synchronize()
            ok.append(1.0)
          except Exception as e:  # noqa: BLE001
            rec["variants"][name] = {"error": short_error(e)}
            ok.append(0.0)
        bad = agree_max([1.0 - v for v in ok])  # a variant runs only where it ran on all ranks
        for (name, _), b in zip(list(fns.items()), bad):
          if b:
            rec["variants"].setdefault(name, {"error": "failed on another rank"})
            fns.pop(name)
            outs.pop(name, None)
        if "torch_symm_mem" in outs and "torch_nccl" in outs:
          x, y = outs["torch_symm_mem"].float(), outs["torch_nccl"].float()
          rec["rel_err_reference"] = "torch_nccl"
          rec["variants"].setdefault("torch_symm_mem", {})["rel_err"] = float(
              f"{((x - y).norm() / y.norm().clamp_min(1e-30)).item():.3g}")
        outs.clear()
        warm_state = {}

        def on_warm():
          if main_rank:  # read while the timed rounds run
            warm_state["s"] = harness.gpu_state_async()

        timings = harness.time_interleaved(
            {n: f for n, (f, _) in fns.items()}, {n: a for n, (_, a) in fns.items()},
            floor="floor", rounds=args.rounds, target_ms=30.0,
            warmup_s=args.warmup_first_s if first else args.warmup_s,
            agree_max=agree_max, tick=tick, on_warm=on_warm, sync=sync, align=align)
        first = False
        for n, t in timings.items():
          rec["variants"].setdefault(n, {}).update(t)
        if main_rank:
          rec["gpu_state_warm"] = warm_state["s"]() if "s" in warm_state else []
          rec["gpu_state_end"] = harness.gpu_state()
        del fns
      except Exception as e:  # noqa: BLE001
        rec["error"] = short_error(e, 600)
      rec["elapsed_s"] = round(time.time() - t0, 1)
      spent.append(time.time() - t0)
      result["records"].append(rec)
      save()
      if main_rank:
        parts = [f"{n} {v['median_ms']:.3f} ({v.get('over_floor', float('nan')):.3f})"
                 if "median_ms" in v else f"{n} ERR[{str(v.get('error'))[:100]}]"
                 for n, v in rec["variants"].items()]
        say(f"{PART} {op} {shape_str(shape)}: " + ("  ".join(parts) or rec.get("error", "?"))
            + f" | {harness.gpu_state_str(rec.get('gpu_state_warm') or rec.get('gpu_state_end', []))}")
      torch.cuda.empty_cache()
  if args.profile:
    budget.start("profile")
    hung = {(h.get("op"), h.get("shape")) for h in result.get("hangs", [])
            if "profile" in str(h.get("what"))}  # after --resume: not again
    spent = []
    for item in args.profile:
      op, _, text = item.partition(":")
      estimate = max(spent) if spent else 5.0
      if (op, text) in hung or not decide(budget.fits(estimate)):
        result.setdefault("profiles", []).append(
            {"profile": item, "skipped": "hung before" if (op, text) in hung else
             f"budget (needs ~{estimate:.0f} s, {budget.part_left():.0f} s left)"})
        save()
        continue
      t0 = time.time()
      entry = run_profile(item)
      spent.append(time.time() - t0)
      result.setdefault("profiles", []).append(entry)
      save()
      if main_rank:
        say(f"{PART} profile {item}: " + "  ".join(
            f"{n} {v.get('trace') or 'ERR[' + str(v.get('error'))[:100] + ']'}"
            for n, v in entry["variants"].items()) + (f" {entry['error']}" if "error" in entry else ""))
  watchdog.stop()
  add_sweep_copies(result)
  result["finished"] = True
  save()
  try:
    dist.destroy_process_group()
  except Exception:  # noqa: BLE001
    pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
