"""Whether jax's cuDNN attention runs in FP8 here, at the GPU preset's shape
(batch 4, sequence 2048, 32 heads of 128, causal), forward and backward.

jax exposes it only privately (``jax._src.cudnn.fused_attention_stablehlo.
dot_product_attention(..., use_fp8=True)``). The probe quantizes q, k, v and
the output gradient to E4M3 with per-tensor scales, runs the FP8 attention
and its VJP, compares with float32 attention of the same (dequantized) FP8
values, and times both against cuDNN's bf16 attention. Any refusal is printed
with the library's message. Prints one JSON line last.

Usage: python benchmarks/fp8_attention_probe.py [--small]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

E4M3, F32, BF16 = jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16
META = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v",
        "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO", "descale_dP",
        "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def timed(f, *args, n=20):
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  for _ in range(n):
    out = f(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - t) / n


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--small", action="store_true", help="batch 1, sequence 256, 4 heads")
  args = p.parse_args()
  b, t, n, h = (1, 256, 4, 128) if args.small else (4, 2048, 32, 128)
  scale = 1 / np.sqrt(h)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, g = (jax.random.normal(key, (b, t, n, h), F32) for key in keys)
  # E4M3-representable values (per-tensor scale 1: the inputs are ~N(0, 1)).
  q8, k8, v8, g8 = (jnp.clip(a, -448, 448).astype(E4M3) for a in (q, k, v, g))
  report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "shape_btnh": [b, t, n, h]}

  def reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation="xla")

  def bf16(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation="cudnn")
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    metas = {name: jnp.ones((1, 1, 1, 1), F32) for name in META}

    def fp8(q, k, v, metas):
      return fa.dot_product_attention(q, k, v, fp8_params=metas, scale=scale,
                                      mask_type=fa.MaskType.CAUSAL, use_fp8=True)

    def fp8_train(q, k, v, g, metas):
      out, vjp = jax.vjp(fp8, q, k, v, metas)
      ones = jnp.ones((1, 1, 1, 1), F32)
      return out[0], vjp((g, ones, ones))[:3]

    out, grads = jax.jit(fp8_train)(q8, k8, v8, g8, metas)
    up = lambda a: a.astype(F32)
    ref_out, ref_vjp = jax.vjp(reference, up(q8), up(k8), up(v8))
    ref_grads = ref_vjp(up(g8))
    rel = lambda a, r: float(jnp.linalg.norm(up(a) - r) / jnp.linalg.norm(r))
    report["fp8"] = {"out_rel_err": rel(out, ref_out),
                     "grad_rel_err": [rel(a, r) for a, r in zip(grads, ref_grads)],
                     "out_dtype": str(out.dtype)}
    f8 = jax.jit(fp8_train)
    qb, kb, vb, gb = (a.astype(BF16) for a in (q, k, v, g))
    fb = jax.jit(lambda q, k, v, g: jax.vjp(bf16, q, k, v)[1](g))
    report["fp8"]["ms_fwd_bwd"] = timed(f8, q8, k8, v8, g8, metas)
    report["bf16_ms_fwd_bwd"] = timed(fb, qb, kb, vb, gb)
  except Exception as e:  # the probe's finding: what refused it, in its own words
    report["fp8_error"] = f"{type(e).__name__}: {e}"[:2000]
    traceback.print_exc()
  print(json.dumps(report))


if __name__ == "__main__":
  main()
