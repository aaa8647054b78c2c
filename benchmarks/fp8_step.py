"""The byte GPT's GPU-preset training step on one GPU, bf16 against FP8, the
project's transformer blocks against a plain-XLA FP8 block with no project
code, interleaved in one process. ``--arch llama``: the same for the Llama
preset's blocks (``layers.llama``; d_model 4096, 32 query and 8 key/value heads
of 128, SwiGLU hidden 14336, no biases), the plain reference in plain_llama.py.

The step is loss + gradients of 4 pre-LN blocks (d_model 4096, hidden 16384,
32 heads of 128, sequence 2048 x batch 4 = 8192 tokens), as the example's
blocks run them (``layers.transformer.sharded_transformer_block`` on a mesh of
one GPU, so every dense layer is a plain GEMM). Variants:

* ``project_bf16``: ``CommGemmConfig()``;
* ``project_fp8_tensor``: ``CommGemmConfig(fp8=Fp8Recipe("tensor"))`` (XLA's
  FP8 GEMM, the one-pass cast kernel); ``project_fp8_tensor_xla_casts``: the
  same with XLA's casts and transposes (``casts="xla"``); ``project_fp8_*_cublaslt``: the project's FP8 GEMM custom call
  (``gemm_form="cublaslt"``), per tensor or per row, and per tensor with fast
  accumulation in the forward GEMMs only (``accumulation="fast_forward"``),
  and per 1 x 128 / 128 x 128 block (``project_fp8_block_cublaslt``);
* ``project_fp8_delayed``: ``Fp8Recipe("delayed")``, the histories in steady
  state (the first call's next histories) and their gradient (the next
  histories) computed in every step, as training does;
  ``project_fp8_delayed_heads_outside``: the same with attention's layout
  changed by XLA's copies around the FP8 ops, not inside the backward's casts;
  with ``--arch llama``, ``project_fp8_delayed_glu_outside``: the same with the
  gated product ``silu(gate) * up`` and its gradient in XLA's passes (written
  in bf16, then cast), not inside the FP8 casts;
* ``plain_xla_fp8``: the same arithmetic written in plain jax: per-tensor
  current scaling, E4M3 forward and E5M2 gradients, every GEMM contracting
  both operands on their last axis, the transposed FP8 copies made by casts.
  The reference the project's FP8 step must match.

Each variant runs N steps back to back per timed batch, after 3 untimed rounds
of load; rounds alternate in order; median ms per step. The SM clock and power
are printed before and after. Prints a markdown table last; writes JSON.

Usage: python benchmarks/fp8_step.py OUT.json [--smoke] [--arch {gpt,llama}]
       [--only VARIANT ...] [--hlo DIR]
       [--profile DIR [--profile-variants VARIANT ...]] [--steps-per-batch N] [--master-f32]
(--smoke: tiny, CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

import jax_comm_gemm as jcg
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime.constants import TARGETS
from jax_comm_gemm.layers import dense, gated_mlp, llama, transformer as tb

from plain_llama import plain_llama_block

F32, BF16 = jnp.float32, jnp.bfloat16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
LAST = (((1,), (1,)), ((), ()))  # both operands contract on their last axis


def _cast(t, dtype):
  """t in FP8 with a per-tensor scale from its amax: (t8, scale)."""
  scale = jnp.maximum(jnp.max(jnp.abs(t)).astype(F32), 1e-12) / float(jnp.finfo(dtype).max)
  return (t.astype(F32) / scale).astype(dtype), scale


@jax.custom_vjp
def plain_fp8_dense(x, w):
  """x [n, k] @ w [k, m] in FP8, written in plain jax (the reference)."""
  return _plain_fwd(x, w)[0]


def _plain_fwd(x, w):
  x8, sx = _cast(x, E4M3)
  w8, sw = _cast(w, E4M3)
  y = lax.dot_general(x8, w8.T, LAST, preferred_element_type=BF16) * (sx * sw).astype(BF16)
  return y, (x8.T, sx, w8, sw, jnp.zeros((0,), w.dtype))  # the last: w's dtype


def _plain_bwd(res, dy):
  x8t, sx, w8, sw, w_dtype = res
  dy8, sdy = _cast(dy, E5M2)
  dx = lax.dot_general(dy8, w8, LAST, preferred_element_type=BF16) * (sdy * sw).astype(BF16)
  dw = lax.dot_general(x8t, dy8.T, LAST, preferred_element_type=F32) * (sx * sdy)
  return dx, dw.astype(w_dtype.dtype)


plain_fp8_dense.defvjp(_plain_fwd, _plain_bwd)


def plain_block(p, x, heads, attention):
  """One pre-LN block in plain jax, x [seq, batch, d], FP8 dense layers."""
  s, b, d = x.shape

  def norm(t, q):
    t32 = t.astype(F32)
    mean = t32.mean(-1, keepdims=True)
    var = ((t32 - mean) ** 2).mean(-1, keepdims=True)
    return ((t32 - mean) * lax.rsqrt(var + 1e-6) * q["scale"] + q["bias"]).astype(BF16)

  def dense(t, q):
    return plain_fp8_dense(t.reshape(-1, t.shape[-1]), q["kernel"]) + q["bias"].astype(BF16)

  qkv = dense(norm(x, p["ln_1"]), p["attention"]["qkv"]).reshape(s, b, heads, 3, d // heads)
  q, k, v = (jnp.swapaxes(qkv[:, :, :, i], 0, 1) for i in range(3))
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
  x = x + dense(jnp.swapaxes(a, 0, 1).reshape(s * b, d), p["attention"]["out"]).reshape(x.shape)
  h = jax.nn.gelu(dense(norm(x, p["ln_2"]), p["mlp"]["fc1"]))
  return x + dense(h, p["mlp"]["fc2"]).reshape(x.shape)


FP8_GEMM_TARGET = TARGETS["fp8_gemm"]


class WithHistories:
  """(params, x) -> (loss, (d params, dx, next histories)) of a jitted step
  that also takes a delayed recipe's histories: empty at the first call, then
  the ones that call returned (non-empty, as in training), kept fixed."""

  def __init__(self, f, histories):
    self.f, self.histories, self.warm = f, histories, False

  def __call__(self, ps, x):
    out = self.f(ps, x, self.histories)
    if not self.warm:
      self.histories, self.warm = out[1][2], True
    return out

  def lower(self, ps, x):
    return self.f.lower(ps, x, self.histories)


class HeadsOutside(WithHistories):
  """A step traced with attention's layout changed by XLA's copies outside the
  FP8 ops (``dense.heads_inside`` off), as before the casts took it
  (jax_comm_gemm.fp8.heads); its block runs on an axis name of its own, so
  that its jit traces afresh (and every trace, lower's too, is patched)."""
  patch = staticmethod(lambda: mock.patch.object(dense, "heads_inside",
                                                 lambda config, dot_general: False))

  def __call__(self, ps, x):
    with self.patch():
      return super().__call__(ps, x)

  def lower(self, ps, x):
    with self.patch():
      return super().lower(ps, x)


class GluOutside(HeadsOutside):
  """A Llama step traced with the gated product and its gradient in XLA's
  passes, outside the FP8 casts (``gated_mlp.product_inside`` off), as before
  the casts made them; on an axis name of its own, as HeadsOutside."""
  patch = staticmethod(lambda: mock.patch.object(gated_mlp, "product_inside",
                                                 lambda config: False))


def steps(mesh, heads, attention, layers, kv_heads=None):
  """{variant: jitted (params, x) -> (loss, grads)}; with `kv_heads`, of
  Llama blocks (``layers.llama``; the plain reference ``plain_llama.py``)."""
  def project(config, step=WithHistories, axis="tp"):
    if kv_heads is None:
      options = tb.BlockOptions(num_heads=heads, dtype=BF16,
                                attention_implementation=attention, config=config)
      block = tb.sharded_transformer_block
    else:
      options = llama.LlamaOptions(num_heads=heads, num_kv_heads=kv_heads, dtype=BF16,
                                   attention_implementation=attention, config=config)
      block = llama.sharded_llama_block
    on = mesh if axis == "tp" else Mesh(mesh.devices, (axis,))

    def loss(ps, x, hs):
      for p, h in zip(ps, hs):
        x = block(x, p, mesh=on, axis_name=axis, options=options, fp8_histories=h)
      return jnp.mean(x.astype(F32) ** 2)
    histories = [tb.init_fp8_histories(options)] * layers  # Nones but for "delayed"
    return step(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), histories)

  def plain(ps, x):
    for p in ps:
      x = (plain_block(p, x, heads, attention) if kv_heads is None
           else plain_llama_block(p, x, heads, attention, plain_fp8_dense))
    return jnp.mean(x.astype(F32) ** 2)

  return {"project_bf16": project(jcg.CommGemmConfig()),
          "project_fp8_tensor": project(jcg.CommGemmConfig(fp8=Fp8Recipe("tensor"))),
          "project_fp8_delayed": project(jcg.CommGemmConfig(fp8=Fp8Recipe("delayed"))),
          "project_fp8_delayed_heads_outside": project(
              jcg.CommGemmConfig(fp8=Fp8Recipe("delayed")), HeadsOutside, "tp_outside"),
          # XLA's casts and transposes in place of the one-pass kernel (jax_comm_gemm.fp8.cast).
          "project_fp8_tensor_xla_casts": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("tensor", casts="xla"))),
          # The project's own FP8 GEMM custom call (xla_ffi/fp8_gemm.cc) in place of XLA's.
          "project_fp8_tensor_cublaslt": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("tensor", gemm_form="cublaslt"))),
          "project_fp8_delayed_cublaslt": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("delayed", gemm_form="cublaslt"))),
          "project_fp8_tensor_cublaslt_fast_forward": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("tensor", gemm_form="cublaslt", accumulation="fast_forward"))),
          "project_fp8_row_cublaslt": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("row", gemm_form="cublaslt"))),
          "project_fp8_block_cublaslt": project(jcg.CommGemmConfig(
              fp8=Fp8Recipe("block", gemm_form="cublaslt"))),
          **({} if kv_heads is None else {"project_fp8_delayed_glu_outside": project(
              jcg.CommGemmConfig(fp8=Fp8Recipe("delayed")), GluOutside, "tp_glu")}),
          "plain_xla_fp8": jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))}


def clocks() -> str:
  try:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                           "--format=csv,noheader"], capture_output=True, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "n/a"


def batch_of(step, n, ps, x):
  """`n` steps dispatched back to back, then waited for."""
  out = None
  for _ in range(n):
    out = step(ps, x)
  jax.block_until_ready(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few rounds (CPU)")
  parser.add_argument("--arch", choices=("gpt", "llama"), default="gpt",
                      help="the blocks: 'gpt' (pre-LN, GELU MLP; the byte GPT's GPU preset) or "
                           "'llama' (RMSNorm, SwiGLU, grouped-query attention, rotary, no "
                           "biases: d 4096, 32 query heads and 8 key/value heads of 128, "
                           "hidden 14336, as the example's --arch llama GPU preset)")
  parser.add_argument("--no-bias", action="store_true",
                      help="dense layers without biases (the project's variants only)")
  parser.add_argument("--hlo", metavar="DIR",
                      help="write each variant's optimized HLO to DIR/VARIANT.hlo.txt")
  parser.add_argument("--profile", metavar="DIR",
                      help="after timing, trace 3 steps of each --profile-variants variant "
                           "(annotated 'step'), then one batch of steps back to back "
                           "('batch'), into DIR/VARIANT (with its optimized HLO as "
                           "step.hlo.txt, for benchmarks/producers.py)")
  parser.add_argument("--profile-variants", nargs="+", metavar="VARIANT",
                      default=["project_bf16", "project_fp8_tensor"])
  parser.add_argument("--only", nargs="+", metavar="VARIANT",
                      help="these variants only (project_bf16 always runs: the baseline)")
  parser.add_argument("--steps-per-batch", type=int, default=5, metavar="N",
                      help="steps dispatched back to back per timed batch (default 5)")
  parser.add_argument("--master-f32", action="store_true",
                      help="parameters in float32, as the example keeps them (each variant "
                           "casts them as its layers do: bf16 GEMMs read bf16 copies, the "
                           "FP8 ops cast the kernels from float32)")
  args = parser.parse_args()
  d, hidden, heads, layers, seq, batch = ((64, 128, 2, 2, 16, 2) if args.smoke
                                          else (4096, 16384, 32, 4, 2048, 4))
  kv_heads = None
  if args.arch == "llama":
    hidden, heads, kv_heads = (128, 4, 2) if args.smoke else (14336, 32, 8)
  rounds, per_batch = (2, 1) if args.smoke else (10, args.steps_per_batch)
  attention = None if args.smoke else "cudnn"
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  if kv_heads is None:
    layout = tb.param_layout(d, hidden, "tp", use_bias=not args.no_bias)
  else:  # Llama's blocks have no biases
    layout = llama.param_layout(d, hidden, llama.LlamaOptions(heads, kv_heads), "tp")
  ps = []
  for i in range(layers):
    leaves, tree = jax.tree_util.tree_flatten_with_path(
        layout, is_leaf=lambda s: isinstance(s, tb.ParamSpec))
    keys = jax.random.split(jax.random.key(i), len(leaves))

    def init(key, path, spec):  # kernels ~ k^-1/2, LayerNorm scales 1, biases 0
      if len(spec.shape) >= 2:  # Llama's [d, 2, F] too: fan-in d
        return (jax.random.normal(key, spec.shape, F32) / np.sqrt(spec.shape[0])).astype(BF16)
      scale = "scale" in jax.tree_util.keystr(path)
      return (jnp.ones if scale else jnp.zeros)(spec.shape, BF16)
    if args.master_f32:
      init = lambda key, path, spec, init=init: init(key, path, spec).astype(F32)
    ps.append(jax.tree.unflatten(tree, [init(k, path, spec)
                                        for k, (path, spec) in zip(keys, leaves)]))
  x = jax.random.normal(jax.random.key(99), (seq, batch, d), F32).astype(BF16)
  variants = steps(mesh, heads, attention, layers, kv_heads)
  if args.only:
    variants = {n: f for n, f in variants.items() if n in {"project_bf16", *args.only}}
  results = {}
  for name, f in variants.items():
    t0 = time.perf_counter()
    loss, grads = f(ps, x)
    gx = grads[1]
    jax.block_until_ready(gx)
    text = f.lower(ps, x).compile().as_text()
    if args.hlo:
      os.makedirs(args.hlo, exist_ok=True)
      with open(os.path.join(args.hlo, f"{name}.hlo.txt"), "w") as out:
        out.write(text)
    results[name] = {"loss": float(loss), "compile_s": time.perf_counter() - t0,
                     "gx_norm": float(jnp.linalg.norm(gx.astype(F32))),
                     "f8_gemms": (text.count('custom_call_target="__cublas$lt$matmul$f8"')
                                  + text.count(f'custom_call_target="{FP8_GEMM_TARGET}"')),
                     "bf16_gemms": text.count('custom_call_target="__cublas$lt$matmul"'),
                     "cudnn_calls": text.count("__cudnn")}
    print(name, results[name], flush=True)
  before, times = clocks(), {name: [] for name in variants}
  order = list(variants)
  for index in range(3 + rounds):
    for name in (order if index % 2 == 0 else order[::-1]):
      t = time.perf_counter()
      batch_of(variants[name], per_batch, ps, x)
      if index >= 3:
        times[name].append((time.perf_counter() - t) / per_batch)
  for name in (args.profile_variants if args.profile else ()):
    where = os.path.join(args.profile, name)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "step.hlo.txt"), "w") as out:
      out.write(variants[name].lower(ps, x).compile().as_text())
    with jax.profiler.trace(where, create_perfetto_trace=True):
      for _ in range(3):
        with jax.profiler.TraceAnnotation("step"):
          jax.block_until_ready(variants[name](ps, x))
      with jax.profiler.TraceAnnotation("batch"):  # as the timing runs them
        batch_of(variants[name], per_batch, ps, x)
  for name in variants:
    results[name]["ms"] = 1e3 * float(np.median(times[name]))
    results[name]["tokens_per_s"] = seq * batch / (results[name]["ms"] / 1e3)
  results["meta"] = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                     "clocks_before": before, "clocks_after": clocks(),
                     "shape": dict(arch=args.arch, d=d, hidden=hidden, heads=heads,
                                   kv_heads=kv_heads, layers=layers, seq=seq, batch=batch),
                     "rounds": rounds, "steps_per_batch": per_batch,
                     "params": "float32" if args.master_f32 else "bfloat16"}
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  base = results["project_bf16"]["ms"]
  print(f"\n{results['meta']['device']}, jax {jax.__version__}, "
        f"{results['meta']['params']} parameters; clocks "
        f"{before} -> {results['meta']['clocks_after']}")
  print("| variant | ms/step | tokens/s | speed-up over project bf16 | f8 GEMMs | bf16 GEMMs |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name in variants:
    r = results[name]
    print(f"| {name} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {base / r['ms']:.3f} | "
          f"{r['f8_gemms']} | {r['bf16_gemms']} |")


if __name__ == "__main__":
  main()
