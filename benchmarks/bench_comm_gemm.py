"""Times the fused ops through jax against XLA's own collectives and the GEMM-only
floor, interleaved, on all local GPUs of one process.

The lent H200s hit their power cap under sustained GEMMs and clock down within
seconds, so: warm up for several seconds of load, interleave the variants
(A B C A B C ...), take medians of per-round times and of per-round ratios, and
print the SM clock and power beside the numbers. Data is random normal bf16.

Usage: python benchmarks/bench_comm_gemm.py --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from functools import partial

import jax
import jaxlib
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from jax_comm_gemm import backends, dense, ffi_ops

AG_SHAPES = ((8192, 8192, 28672), (16384, 8192, 8192), (4096, 4096, 4096))
RS_SHAPES = ((8192, 28672, 8192), (16384, 8192, 8192), (4096, 4096, 4096))
MLP_SHAPES = ((8192, 8192, 28672), (16384, 4096, 16384))
RS_ALGORITHMS = ("split_p2p", "no_overlap", "default")


def gpu_state() -> str:
  out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout
  return " | ".join(line.strip() for line in out.splitlines())


def machine() -> dict:
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout
  status = jcg.cublasmp_status()
  return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__,
          "python": platform.python_version(), "gpus": smi.strip().splitlines(),
          "cublasmp": status.reason, "devices": len(jax.devices())}


def rand(key, shape, mesh, spec, scale=1.0):
  sharding = NamedSharding(mesh, spec)
  f = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16),
              out_shardings=sharding)
  return f(jax.random.key(key))


def interleaved(variants: dict, args: dict, *, rounds=8, warmup_s=4.0, target_ms=60.0):
  """Median ms per call of each variant, timed in interleaved rounds."""
  ok = {}
  for name, fn in variants.items():
    try:
      jax.block_until_ready(fn(*args[name]))
      ok[name] = fn
    except Exception as e:  # noqa: BLE001  (a variant cuBLASMp refuses is a result)
      ok[name] = f"error: {str(e)[:300]}"
  runnable = {k: v for k, v in ok.items() if callable(v)}
  iters = {}
  for name, fn in runnable.items():
    t = time.perf_counter()
    jax.block_until_ready(fn(*args[name]))
    once = (time.perf_counter() - t) * 1e3
    iters[name] = max(3, min(200, int(target_ms / max(once, 1e-3))))
  end = time.time() + warmup_s
  while time.time() < end:  # reach the power-capped steady state
    for name, fn in runnable.items():
      jax.block_until_ready(fn(*args[name]))
  times = {name: [] for name in runnable}
  for _ in range(rounds):
    for name, fn in runnable.items():
      a = args[name]
      t = time.perf_counter()
      for _ in range(iters[name]):
        r = fn(*a)
      jax.block_until_ready(r)
      times[name].append((time.perf_counter() - t) / iters[name] * 1e3)
  result = {name: {"median_ms": float(np.median(v)), "rounds_ms": v, "iters": iters[name]}
            for name, v in times.items()}
  for name, v in ok.items():
    if not callable(v):
      result[name] = {"error": v}
  result["_gpu_state"] = gpu_state()
  return result


def ratio(result, a, b):
  """Median over rounds of time(a) / time(b)."""
  if "rounds_ms" not in result.get(a, {}) or "rounds_ms" not in result.get(b, {}):
    return None
  return float(np.median(np.array(result[a]["rounds_ms"]) / np.array(result[b]["rounds_ms"])))


def smap(mesh, fn, in_specs, out_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def bench_all_gather_matmul(mesh, shapes):
  out = []
  for n, k, m in shapes:
    x = rand(1, (n, k), mesh, P("tp"))
    xg = rand(1, (n, k), mesh, P())
    w = rand(2, (k, m), mesh, P(None, "tp"), k**-0.5)
    fused = backends.CublasMpBackend()
    variants = {
        "fused": smap(mesh, lambda x, w: fused.all_gather_matmul(
            x, w, "tp", transpose_w=False, return_gathered=False),
                      (P("tp"), P(None, "tp")), P(None, "tp")),
        "fused+gathered": smap(mesh, lambda x, w: ffi_ops.all_gather_matmul(
            x, w, "tp", transpose_w=False, return_gathered=True, algorithm=1,
            layout=jcg.REGISTRY.default_layout()),
                               (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp"))),
        "xla": smap(mesh, lambda x, w: backends.XlaBackend().all_gather_matmul(
            x, w, "tp", transpose_w=False, return_gathered=False),
                    (P("tp"), P(None, "tp")), P(None, "tp")),
        "floor": smap(mesh, lambda xg, w: backends.local_matmul(xg, w, False),
                      (P(), P(None, "tp")), P(None, "tp")),
    }
    args = {k_: (x, w) for k_ in variants}
    args["floor"] = (xg, w)
    r = interleaved(variants, args)
    r["shape"] = [n, k, m]
    r["xla/fused"] = ratio(r, "xla", "fused")
    r["fused/floor"] = ratio(r, "fused", "floor")
    r["copy_ms"] = (r["fused+gathered"]["median_ms"] - r["fused"]["median_ms"]
                    if "median_ms" in r.get("fused+gathered", {}) else None)
    out.append(r)
    print(f"AG+GEMM {n}x{k}x{m}: " + summary(r, ("fused", "fused+gathered", "xla", "floor"))
          + f" | xla/fused {fmt(r['xla/fused'])} fused/floor {fmt(r['fused/floor'])}"
          + f" | {r['_gpu_state']}", flush=True)
  return out


def bench_matmul_reduce_scatter(mesh, shapes):
  out = []
  for n, k, m in shapes:
    x = rand(3, (n, k), mesh, P(None, "tp"))
    w = rand(4, (k, m), mesh, P("tp"), k**-0.5)
    specs = ((P(None, "tp"), P("tp")), P("tp"))
    variants = {"xla": smap(mesh, lambda x, w: backends.XlaBackend().matmul_reduce_scatter(
        x, w, "tp", transpose_w=False), *specs)}
    for algorithm in RS_ALGORITHMS:
      variants[f"fused_{algorithm}"] = smap(mesh, partial(
          lambda x, w, a: ffi_ops.matmul_reduce_scatter(x, w, "tp", transpose_w=False,
                                                        algorithm=jcg.ALGORITHMS[a]),
          a=algorithm), *specs)
    variants["ring"] = smap(mesh, lambda x, w: backends.ring_matmul_reduce_scatter(
        x, w, "tp", False), *specs)
    variants["floor"] = smap(mesh, lambda x, w: backends.local_matmul(x, w, False),
                             specs[0], P("tp"))
    args = {k_: (x, w) for k_ in variants}
    r = interleaved(variants, args)
    r["shape"] = [n, k, m]
    for name in variants:
      if name != "xla":
        r[f"xla/{name}"] = ratio(r, "xla", name)
    out.append(r)
    print(f"GEMM+RS {n}x{k}x{m}: " + summary(r, tuple(variants))
          + " | " + " ".join(f"xla/{v} {fmt(r.get(f'xla/{v}'))}" for v in variants if v != "xla")
          + f" | {r['_gpu_state']}", flush=True)
  return out


def pure_jax_mlp(x, w1, w2):
  """What a JAX user writes without this project: autodiff does the rest."""
  h = lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
  return lax.psum_scatter(jax.nn.gelu(h) @ w2, "tp", scatter_dimension=0, tiled=True)


def bench_mlp(mesh, shapes):
  out = []
  for n, d, f in shapes:
    x = rand(5, (n, d), mesh, P("tp"))
    w1 = rand(6, (d, f), mesh, P(None, "tp"), d**-0.5)
    w2 = rand(7, (f, d), mesh, P("tp"), f**-0.5)
    specs = ((P("tp"), P(None, "tp"), P("tp")), (P(), (P("tp"), P(None, "tp"), P("tp"))))

    def step(body):
      def loss(x, w1, w2):
        return lax.psum(jnp.sum(body(x, w1, w2).astype(jnp.float32)), "tp")
      return smap(mesh, jax.value_and_grad(loss, argnums=(0, 1, 2)), *specs)

    def ours(keep=False, **kw):
      config = jcg.CommGemmConfig(**kw)
      return step(lambda x, w1, w2: dense.mlp(x, w1, w2, axis_name="tp", config=config,
                                              keep_gathered_input=keep))

    variants = {
        "fused_reuse": ours(backend="cublasmp"),
        "fused_reuse_keep": ours(backend="cublasmp", keep=True),
        "fused_reuse_keep_ring": ours(backend="cublasmp", keep=True, reduce_scatter="ring"),
        "fused_reuse_keep_rs_default": ours(backend="cublasmp", keep=True,
                                            reduce_scatter="default"),
        "fused_no_reuse": ours(backend="cublasmp", reuse_gathered=False),
        "xla_fallback": ours(backend="xla"),
        "pure_jax": step(pure_jax_mlp),
    }
    args = {k_: (x, w1, w2) for k_ in variants}
    r = interleaved(variants, args, target_ms=150.0)
    r["shape"] = [n, d, f]
    for name in variants:
      if name != "pure_jax":
        r[f"pure_jax/{name}"] = ratio(r, "pure_jax", name)
    out.append(r)
    print(f"SP-MLP fwd+bwd {n}x{d}x{f}: " + summary(r, tuple(variants))
          + " | " + " ".join(f"pure_jax/{v} {fmt(r.get(f'pure_jax/{v}'))}"
                             for v in variants if v != "pure_jax")
          + f" | {r['_gpu_state']}", flush=True)
  return out


def bench_host_blocking(mesh):
  """Does a fused call hold the host until the GPU finishes? Compare the time
  to enqueue 20 calls with the time until they are done."""
  n, k, m = 16384, 8192, 8192
  x = rand(1, (n, k), mesh, P("tp"))
  w = rand(2, (k, m), mesh, P(None, "tp"), k**-0.5)
  out = {}
  for name, backend in (("fused", backends.CublasMpBackend()), ("xla", backends.XlaBackend())):
    f = smap(mesh, lambda x, w, b=backend: b.all_gather_matmul(
        x, w, "tp", transpose_w=False, return_gathered=False), (P("tp"), P(None, "tp")),
             P(None, "tp"))
    jax.block_until_ready(f(x, w))
    t0 = time.perf_counter()
    for _ in range(20):
      r = f(x, w)
    t1 = time.perf_counter()
    jax.block_until_ready(r)
    t2 = time.perf_counter()
    out[name] = {"enqueue_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3}
  print(f"host blocking (20 calls of AG+GEMM {n}x{k}x{m}): " + " ".join(
      f"{k_} enqueue {v['enqueue_ms']:.1f} ms of {v['total_ms']:.1f} ms" for k_, v in out.items()),
        flush=True)
  return out


def fmt(v):
  return "n/a" if v is None else f"{v:.3f}"


def summary(r, names):
  parts = []
  for name in names:
    v = r.get(name, {})
    parts.append(f"{name} {v['median_ms']:.3f}" if "median_ms" in v else f"{name} ERR")
  return "median ms " + " ".join(parts)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--quick", action="store_true", help="one shape per section")
  parser.add_argument("--sections", default="ag,rs,mlp,host")
  args = parser.parse_args()
  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  pick = (lambda s: s[1:2]) if args.quick else (lambda s: s)
  result = {"machine": machine()}
  print(json.dumps(result["machine"]), flush=True)
  sections = args.sections.split(",")
  if "ag" in sections:
    result["all_gather_matmul"] = bench_all_gather_matmul(mesh, pick(AG_SHAPES))
  if "rs" in sections:
    result["matmul_reduce_scatter"] = bench_matmul_reduce_scatter(mesh, pick(RS_SHAPES))
  if "mlp" in sections:
    result["mlp"] = bench_mlp(mesh, pick(MLP_SHAPES))
  if "host" in sections:
    result["host_blocking"] = bench_host_blocking(mesh)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
