"""One GPU: the project's FP8 GEMM (jax_comm_gemm.fp8.gemm) beside jax's bf16
dot and torch._scaled_mm, at the per-GPU shapes of the benchmark.

Shapes are m x k x n with a (m, k): the TP-2 per-rank GEMMs of bench.py's
AllGather+GEMM shapes (all tokens gathered, half the output features).
Variants, per shape:

* ``jax_bf16``: ``a @ b`` in bf16, b (k, n);
* ``fp8_direct``: ``fp8_gemm_tn`` in XLA's form, a8 (m, k) and the weight's TN
  copy b8 (n, k) in E4M3, per-tensor scales, bf16 out (its other form,
  dequant_f32, was slower at every shape: docs/fp8.md);
* ``fp8_cublaslt``: the project's FP8 GEMM custom call (xla_ffi/fp8_gemm.cc) on
  the same operands, its algorithm timed at the first call;
  ``fp8_cublaslt_heuristic``: the same with cuBLASLt's first heuristic choice;
  ``fp8_cublaslt_row``: with per-row scales (OUTER_VEC_32F);
* ``torch_scaled_mm``: ``torch._scaled_mm`` with per-tensor scales, bf16 out,
  the weight column-major ((n, k) row-major, transposed), if torch imports;
  ``torch_scaled_mm_row``: the same with per-row scales (rowwise scaling).

Timing: the variants interleaved; per round and variant 3 calls of one program
that runs 20 GEMMs back to back, each on its own a (as the GEMMs of a training
step run inside one executable; one jitted call per GEMM would time jax's
dispatch too), and one sync; after >= 3 s of warm-up load, the median over >=
12 rounds, ms per GEMM. Prints the SM clock and power before and after (nvidia-smi), a
markdown table with each variant's ratio to torch, writes a JSON, and checks
the optimized HLO of the project's GEMM: one FP8 GEMM and no transpose, asserted
on GPU. The GEMM is a ``__cublas$lt$matmul$f8`` call, or where XLA's autotuner
finds one faster a Triton GEMM fusion on the FP8 operands (seen on one H200 at
4096x4096x2048 and 2048x8192x4096 in the direct form); both are printed.

  python3 benchmarks/fp8_gemm.py [--out fp8_gemm.json] [--hlo fp8_gemm_hlo.txt]
  python3 benchmarks/fp8_gemm.py --smoke     # CPU, tiny shapes, no torch
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_comm_gemm.fp8.gemm import cublaslt_gemm_tn, fp8_gemm_tn  # noqa: E402
from jax_comm_gemm.fp8.quantize import quantize_rows, quantize_tensor  # noqa: E402
from jax_comm_gemm.runtime.constants import TARGETS  # noqa: E402

SHAPES = ((8192, 8192, 14336), (16384, 8192, 4096), (8192, 8192, 3584),
          (8192, 4096, 2048), (4096, 4096, 2048), (2048, 8192, 4096))
SMOKE_SHAPES = ((64, 64, 32), (32, 64, 64))
CALLS = 20    # GEMMs in one program (one torch call: as many launches)
REPEATS = 3   # programs per timed sample
F8 = jnp.float8_e4m3fn
FP8_TARGET = "__cublas$lt$matmul$f8"
PROJECT_TARGET = TARGETS["fp8_gemm"]
# The variants whose HLO is checked, and their rows in the JSON.
CHECKED = ("fp8_direct", "fp8_cublaslt", "fp8_cublaslt_precise", "fp8_cublaslt_row")


def gpu_clocks() -> str:
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"nvidia-smi unavailable ({e})"


def jax_variants(m, k, n):
  """name -> (single, args, many, many_args): the GEMM of one call (compiled,
  for its HLO and its result) and CALLS of them in one program, each on its
  own a (as in a training step, where the GEMMs run back to back inside one
  executable: no dispatch between them to time)."""
  ka, kb = jax.random.split(jax.random.key(m + k + n))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  As = [a * (1 + i / 64) for i in range(CALLS)]
  q_tensor = jax.jit(lambda t: quantize_tensor(t, F8))
  q_rows = jax.jit(lambda t: quantize_rows(t, F8))
  b8, ib = q_tensor(b.T)  # the weight's TN copy, once
  b8r, ibr = q_rows(b.T)
  tensor_as, row_as = [q_tensor(t) for t in As], [q_rows(t) for t in As]
  out = jnp.bfloat16
  # name -> (f(a-operands..., b-operands...), the a-operands of each call, b-operands)
  fns = {"jax_bf16": (lambda a, b: a @ b, [(t,) for t in As], (b,)),
         "fp8_direct": (lambda a8, ia, b8, ib: fp8_gemm_tn(a8, b8, ia, ib, out),
                        tensor_as, (b8, ib)),
         "fp8_cublaslt": (lambda a8, ia, b8, ib: cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=out),
                          tensor_as, (b8, ib)),
         "fp8_cublaslt_heuristic": (lambda a8, ia, b8, ib: cublaslt_gemm_tn(
             a8, b8, ia, ib, out_dtype=out, timed=False), tensor_as, (b8, ib)),
         "fp8_cublaslt_precise": (lambda a8, ia, b8, ib: cublaslt_gemm_tn(
             a8, b8, ia, ib, out_dtype=out, fast_accum=False), tensor_as, (b8, ib)),
         "fp8_cublaslt_row": (lambda a8, ia, b8, ib: cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=out),
                              row_as, (b8r, ibr))}
  variants = {}
  for name, (f, per_call, fixed) in fns.items():
    args = (*per_call[0], *fixed)
    single = jax.jit(f).lower(*args).compile()
    many = jax.jit(lambda calls, fixed, f=f: [f(*c, *fixed) for c in calls])
    variants[name] = (single, args, many.lower(per_call, fixed).compile(), (per_call, fixed))
  return variants


def precision(variant: str) -> str:
  """"fp8_tensor", "fp8_row" or "bf16": what a variant's GEMM runs in."""
  if variant.startswith(("fp8_", "torch_scaled_mm")):
    return "fp8_row" if variant.endswith("_row") else "fp8_tensor"
  return "bf16"


def rel_err(got, ref) -> float:
  got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))


def torch_variant(m, k, n):
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  tas = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * (1 + i / 64)).to(
      torch.float8_e4m3fn) for i in range(CALLS)]
  tb = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
  tb = (tb * 448).to(torch.float8_e4m3fn).t()  # (k, n), column-major as torch requires
  sa = torch.tensor(1.0, device="cuda")
  sb = torch.tensor(1.0 / 448, device="cuda")

  ra = torch.rand(m, 1, device="cuda") + 0.5  # rowwise: [m, 1] and [1, n], float32
  rb = torch.rand(1, n, device="cuda") / 448 + 1e-3

  def call():  # CALLS GEMMs, as the jax variants' programs
    return [torch._scaled_mm(ta, tb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            for ta in tas]

  def call_row():
    return [torch._scaled_mm(ta, tb, scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16)
            for ta in tas]

  return call, call_row, torch.cuda.synchronize


def hlo_check(compiled) -> dict:
  """The GEMMs of the optimized HLO: cuBLASLt FP8 calls, Triton GEMM fusions
  (XLA's autotuner may pick one, FP8 operands and scales fused), and any
  transpose in the program."""
  text = compiled.as_text()
  lines = text.splitlines()
  cublas = [ln for ln in lines if f'custom_call_target="{FP8_TARGET}"' in ln
            or f'custom_call_target="{PROJECT_TARGET}"' in ln]
  triton = [ln for ln in lines if re.search(r"=\s*\S+\s+fusion\(", ln) and "kind=kCustom" in ln
            and ("gemm_fusion" in ln or "__triton_gemm" in ln)]
  transposes = [ln.strip()[:160] for ln in lines
                if re.search(r"=\s*\S+\s+transpose\(", ln) or "wrapped_transpose" in ln]
  return {"fp8_gemm_calls": len(cublas), "triton_gemm_fusions": len(triton),
          "transposes": transposes, "text": text,
          "ok": len(cublas) + len(triton) == 1 and not transposes}


def time_round(call, sync) -> float:
  """Seconds per GEMM: REPEATS calls of CALLS GEMMs each, back to back, then a
  sync (the launch of the first call is then ~1% of the time)."""
  t = time.perf_counter()
  for _ in range(REPEATS):
    r = call()
  sync(r)
  return (time.perf_counter() - t) / (CALLS * REPEATS)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no torch/nvidia-smi")
  p.add_argument("--out", default="fp8_gemm.json")
  p.add_argument("--hlo", default="fp8_gemm_hlo.txt")
  p.add_argument("--rounds", type=int, default=12)
  p.add_argument("--warmup-s", type=float, default=3.0)
  p.add_argument("--shapes", help="only these, e.g. 4096x4096x2048,2048x8192x4096")
  p.add_argument("--profile", metavar="DIR",
                 help="after timing each shape, trace one sample of every variant into "
                      "DIR (jax.profiler; annotated '<variant>@<shape>')")
  args = p.parse_args(argv)
  smoke = args.smoke
  shapes = SMOKE_SHAPES if smoke else SHAPES
  if args.shapes:
    shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
  rounds, warmup_s = (3, 0.2) if smoke else (max(12, args.rounds), max(3.0, args.warmup_s))
  gpu = jax.devices()[0].platform == "gpu"
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "smoke": smoke,
          "gemms_per_program": CALLS, "programs_per_sample": REPEATS, "rounds": rounds}
  if not smoke:
    meta["clocks_before"] = gpu_clocks()
    print("SM clock, max, power, temperature:", meta["clocks_before"], flush=True)
  rows, hlo_dump, failed = [], [], []
  for (m, k, n) in shapes:
    t0 = time.perf_counter()
    jv = jax_variants(m, k, n)  # compiles (XLA autotunes the GEMMs here)
    compile_s = time.perf_counter() - t0
    variants = {name: (lambda f=many, a=margs: f(*a), jax.block_until_ready)
                for name, (_, _, many, margs) in jv.items()}
    checks = {name: hlo_check(jv[name][0]) for name in CHECKED}  # the single call's HLO
    for name, c in checks.items():
      hlo_dump.append(f"===== {m}x{k}x{n} {name}: FP8 GEMM calls x{c['fp8_gemm_calls']}, "
                      f"Triton GEMM fusions {c['triton_gemm_fusions']}, transposes "
                      f"{c['transposes']}\n{c['text']}")
      if gpu and not c["ok"]:
        failed.append(f"{m}x{k}x{n} {name}")
    ref = jv["jax_bf16"][0](*jv["jax_bf16"][1])  # a @ b in bf16, the first call's a
    errs = {name: rel_err(f(*a), ref) for name, (f, a, _, _) in jv.items()
            if name.startswith("fp8_")}
    tv = None if smoke else torch_variant(m, k, n)
    if tv is not None:
      variants["torch_scaled_mm"] = (tv[0], lambda r, s=tv[2]: s())
      variants["torch_scaled_mm_row"] = (tv[1], lambda r, s=tv[2]: s())
    t_end = time.perf_counter() + (warmup_s if not rows else 0.3)
    while time.perf_counter() < t_end:  # warm-up load (clocks up, caches, autotuning)
      for call, sync in variants.values():
        time_round(call, sync)
    times = {name: [] for name in variants}
    for _ in range(rounds):
      for name, (call, sync) in variants.items():
        times[name].append(time_round(call, sync))
    if args.profile:  # one more sample of each, traced (kernels and gaps: trace_summary.py)
      with jax.profiler.trace(f"{args.profile}/{m}x{k}x{n}", create_perfetto_trace=True):
        for name, (call, sync) in variants.items():
          with jax.profiler.TraceAnnotation(f"{name}@{m}x{k}x{n}"):
            time_round(call, sync)
    row = {"shape": f"{m}x{k}x{n}", **{nm: 1e3 * float(np.median(v)) for nm, v in times.items()},
           "fp8_rel_err_vs_bf16": errs, "compile_s": round(compile_s, 2),
           "total_s": round(time.perf_counter() - t0, 2),
           "hlo": {f: {key: c[key] for key in ("fp8_gemm_calls", "triton_gemm_fusions",
                                              "transposes", "ok")} for f, c in checks.items()}}
    rows.append(row)
    print(row["shape"], {nm: round(row[nm], 4) for nm in variants}, "err", errs,
          f"compile {row['compile_s']} s of {row['total_s']} s", flush=True)
  if not smoke:
    meta["clocks_after"] = gpu_clocks()
    print("SM clock, max, power, temperature:", meta["clocks_after"], flush=True)
  names = [nm for nm in rows[0]
           if nm not in ("shape", "fp8_rel_err_vs_bf16", "hlo", "compile_s", "total_s")]
  base = "torch_scaled_mm" if "torch_scaled_mm" in names else None
  print("\n| m x k x n | " + " | ".join(f"{nm} ms" for nm in names)
        + (" | " + " | ".join(f"{nm} / torch" for nm in names if nm != base) if base else "")
        + " |")
  print("| --- " * (1 + len(names) + (len(names) - 1 if base else 0)) + "|")
  for r in rows:
    cells = [f"{r[nm]:.3f}" for nm in names]
    if base:
      cells += [f"{r[nm] / r[base]:.2f}" for nm in names if nm != base]
    print(f"| {r['shape']} | " + " | ".join(cells) + " |")
  for r in rows:
    for name, h in r["hlo"].items():
      print(f"HLO {r['shape']} {name}: FP8 GEMM calls x{h['fp8_gemm_calls']}, Triton GEMM "
            f"fusions x{h['triton_gemm_fusions']}, transposes {len(h['transposes'])}")
  # Also as a part that benchmarks/summarize.py merges into summary.json, each
  # variant with its precision.
  records = [{"op": "gemm_one_gpu", "shape_str": r["shape"],
              "variants": {nm: {"median_ms": r[nm], "precision": precision(nm),
                                **({"rel_err": r["fp8_rel_err_vs_bf16"][nm]}
                                   if nm in r["fp8_rel_err_vs_bf16"] else {})}
                           for nm in names}} for r in rows]
  pathlib.Path(args.out).write_text(json.dumps(
      {"part": "fp8_gemm", "meta": meta, "rows": rows, "records": records}, indent=1))
  pathlib.Path(args.hlo).write_text("\n".join(hlo_dump))
  if failed:
    print("FAILED: not one transpose-free FP8 GEMM in", failed, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
