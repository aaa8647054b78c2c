"""What the own algorithms' split GEMMs cost, on one GPU.

The pipelined plans run a GEMM per block of rows (an AllGather+GEMM: one per
shard; a GEMM+ReduceScatter: chunks x ranks of them) with cuBLASLt's first
heuristic algorithm, where XLA runs one GEMM that it autotuned. In the SP MLP
step at 8192x8192x28672 the 22 split GEMMs took 2.5% longer than XLA's six,
and the step missed its target by about that (docs/performance.md). This probe
separates the parts of that 2.5% that need no second GPU:

* XLA's whole GEMM (jnp's dot, as the floor and the `xla` variant run it);
* cuBLASLt's whole GEMM: the first heuristic choice and the best of the first
  N (gemm_probe.cc times each);
* the blocks: the first choice and the best, times the number of blocks.

Every time is a median over interleaved rounds after seconds of load, on one
GPU (the other GPU's transfers, which run beside the blocks in a step, are
not here). Prints one table; `--json` writes the raw numbers.

  python3 benchmarks/gemm_probe.py [--json FILE]    (docs/gpu-testing.md's machine)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

# (label, whole rows, k, m, NN|TN, block rows...): the MLP steps' GEMMs at TP 2
# (tokens x d x ffn; a rank's ffn is ffn / 2) and the 4096^3 AllGather+GEMM.
# AllGather+GEMM blocks are one shard (rows / 2); GEMM+ReduceScatter blocks are
# rows / 2 / chunks (xla_ffi/pipelined.h: 4 chunks at these shapes, 2 the lever).
GEMMS = (
    ("mlp 8192x8192x28672 fc1 fwd (AG)", 8192, 8192, 14336, "NN", (4096,)),
    ("mlp 8192x8192x28672 fc2 fwd (RS)", 8192, 14336, 8192, "NN", (1024, 2048)),
    ("mlp 8192x8192x28672 fc2 dgrad (AG)", 8192, 8192, 14336, "TN", (4096,)),
    ("mlp 8192x8192x28672 fc1 dgrad (RS)", 8192, 14336, 8192, "TN", (1024, 2048)),
    ("mlp 8192x8192x7168 fc1 fwd (AG)", 8192, 8192, 3584, "NN", (4096,)),
    ("mlp 8192x8192x7168 fc2 fwd (RS)", 8192, 3584, 8192, "NN", (1024, 2048)),
    ("ag 4096^3", 4096, 4096, 2048, "NN", (2048,)),
)


def build(out_dir: str) -> str:
  """Compiles gemm_probe.cc, with xla_ffi/cublaslt.cc and timed_pick.cc (the project's pick),
  against the NVIDIA wheels that the extension's build finds (cmake_hints.py)."""
  import re  # noqa: PLC0415
  import nvidia  # noqa: PLC0415  (the wheels' namespace package)
  source = os.path.join(os.path.dirname(HERE), "xla_ffi")
  hints = subprocess.run([sys.executable, os.path.join(source, "cmake_hints.py")], check=True,
                         capture_output=True, text=True).stdout
  hint = lambda name: re.search(rf'set\({name} "([^"]*)"\)', hints).group(1).split(";")
  roots = [os.path.join(p, sub) for p in nvidia.__path__ for sub in sorted(os.listdir(p))]
  # CUDA 13's headers come in several wheels (crt/ and CCCL's nv/ in their own).
  includes = [d for r in roots for d in (f"{r}/include", f"{r}/include/cccl")] + [
      d for h in hint("JCG_INCLUDE_HINTS") for d in (h, f"{h}/cccl")] + [
      "/usr/local/cuda/include"]  # crt/, where no wheel has it (the GPU machine)
  libs = [r + "/lib" for r in roots] + hint("JCG_LIBRARY_HINTS")
  libs = [d for d in dict.fromkeys(libs) if os.path.isdir(d)]

  def library(prefix):
    return next(f"{d}/{f}" for d in libs for f in sorted(os.listdir(d)) if f.startswith(prefix))

  exe = os.path.join(out_dir, "gemm_probe")
  subprocess.run(["g++", "-O2", "-std=c++17", f"-I{source}",
                  *[f"-I{d}" for d in dict.fromkeys(includes) if os.path.isdir(d)],
                  os.path.join(HERE, "gemm_probe.cc"), os.path.join(source, "cublaslt.cc"),
                  os.path.join(source, "timed_pick.cc"),
                  *[library(p) for p in ("libcublasLt.so.", "libcudart.so.", "libnccl.so",
                                         "libcublasmp.so")],
                  *[f"-Wl,-rpath,{d}" for d in libs], "-o", exe], check=True)
  return exe


def time_lt(exe: str, specs: list[str], candidates: int, seconds: float) -> tuple[dict, dict]:
  """From gemm_probe: {(rows, k, m, kind): [us of candidate 0, 1, ...]}, and
  {(rows, k, m, kind): [the candidate of each of the project's timed picks]}."""
  out = subprocess.run([exe, "--candidates", str(candidates), "--seconds", str(seconds), *specs],
                       check=True, capture_output=True, text=True).stdout
  key = lambda spec: tuple(int(v) if v.isdigit() else v for v in spec.split(","))
  times: dict = {}
  picks: dict = {}
  for line in out.splitlines()[1:]:
    if line.startswith("pick "):
      spec, chosen = line[len("pick "):].split(":")
      picks[key(spec)] = [int(v) for v in chosen.split()]
    else:
      spec, _, us, *_ = line.split()
      times.setdefault(key(spec), []).append(float(us))
  return times, picks


def time_xla(shapes) -> dict:
  """{(rows, k, m, kind): median us} of XLA's dot on the first GPU."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  fns, args = {}, {}
  for i, (rows, k, m, kind) in enumerate(shapes):
    key = jax.random.key(i)
    x = jax.random.normal(key, (rows, k), jnp.float32).astype(jnp.bfloat16)
    w_shape = (m, k) if kind == "TN" else (k, m)
    w = (jax.random.normal(jax.random.fold_in(key, 1), w_shape, jnp.float32)
         * k ** -0.5).astype(jnp.bfloat16)
    contract = 1 if kind == "TN" else 0
    f = jax.jit(lambda x, w, c=contract: lax.dot_general(x, w, (((1,), (c,)), ((), ()))))
    jax.block_until_ready(f(x, w))
    name = ",".join(map(str, (rows, k, m, kind)))
    fns[name], args[name] = f, (x, w)
  got = harness.time_interleaved(fns, args, floor=None, rounds=10, target_ms=20.0)
  return {tuple(int(v) if v.isdigit() else v for v in name.split(",")): r["median_ms"] * 1e3
          for name, r in got.items()}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--candidates", type=int, default=8)
  p.add_argument("--seconds", type=float, default=3.0, help="load before timing")
  p.add_argument("--json", help="write the raw numbers here")
  args = p.parse_args()
  exe = build("/tmp")
  whole = [(rows, k, m, kind) for _, rows, k, m, kind, _ in GEMMS]
  blocks = [(b, k, m, kind) for _, _, k, m, kind, bs in GEMMS for b in bs]
  shapes = list(dict.fromkeys(whole + blocks))
  state = harness.gpu_state()
  lt, picks = time_lt(exe, [",".join(map(str, s)) for s in shapes], args.candidates,
                      args.seconds)
  xla = time_xla(whole)
  state_after = harness.gpu_state()
  print(f"GPU before: {harness.gpu_state_str(state)}; after: {harness.gpu_state_str(state_after)}")
  print("| GEMM | XLA whole us | cuBLASLt whole: 1st / best us | blocks (rows): 1st / best, "
        "summed us | split vs XLA: 1st / best | the project's timed picks of a block: "
        "candidates (their time over the best) |")
  print("| --- | --- | --- | --- | --- | --- |")
  rows_out = []
  for label, rows, k, m, kind, bs in GEMMS:
    w = lt[(rows, k, m, kind)]
    cells = []
    for b in bs:
      t = lt[(b, k, m, kind)]
      n = rows // b
      first, best = t[0] * n, min(t) * n
      cells.append((b, first, best))
      rows_out.append({"gemm": label, "rows": rows, "k": k, "m": m, "kind": kind, "block_rows": b,
                       "xla_us": xla[(rows, k, m, kind)], "lt_whole_us": w,
                       "lt_block_us": t, "picks": picks.get((b, k, m, kind), [])})
    x = xla[(rows, k, m, kind)]
    print(f"| {label} | {x:.1f} | {w[0]:.1f} / {min(w):.1f} | "
          + "; ".join(f"{b}: {f:.1f} / {bb:.1f}" for b, f, bb in cells) + " | "
          + "; ".join(f"{b}: {f / x:.3f} / {bb / x:.3f}" for b, f, bb in cells) + " | "
          + "; ".join(f"{b}: " + " ".join(
              f"{i} ({lt[(b, k, m, kind)][i] / min(lt[(b, k, m, kind)]):.3f})" if i >= 0 else "?"
              for i in picks.get((b, k, m, kind), [])) for b in bs) + " |")
  if args.json:
    harness.write_json(args.json, {"machine": harness.machine_facts(), "gpu_before": state,
                                   "gpu_after": state_after, "rows": rows_out})
  return 0


if __name__ == "__main__":
  sys.exit(main())
