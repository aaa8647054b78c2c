"""The FP8 casts of one operand, XLA's passes against the one-pass Pallas
kernel (:mod:`jax_comm_gemm.fp8.cast`), at the GPU preset's operand shapes.

Per shape and variant: the FP8 copy row-major and transposed from a bf16 x,
with the scale from x's amax first (current scaling: ``*_current``) or given
(delayed scaling, the amax recorded from the same pass: ``*_delayed``), and
the transposed copy of an FP8 x (``*_transpose``: a gathered operand), and
delayed scaling's conditional amax, read or skipped (``amax_if_*``). Also
checks, per shape, that the kernel's bytes equal XLA's (with inf and NaN
planted). Variants interleaved, median of 10 batches of 20 calls after 2 s of
load; prints the SM clock before and after and a markdown table last.

With --activation, GELU (the MLP's activation) before the delayed cast: in a
pass of its own (``gelu_two_passes``), as the kernel's prologue
(``gelu_prologue``, also per tiling), and as the prologue with PTX's
approximate tanh; and GELU's derivative from (dh, pre) before the delayed
cast with column sums (``dgelu_*``: the MLP's backward), in a pass of its
own and per tiling as the prologue. Per
tiling, ``*_delayed_unclipped`` is the delayed cast without the kernel's clip
to the FP8 range (the conversion saturating instead), and the bit-exact column
says whether it writes XLA's bytes on a GPU. (Until 2026-12-04 the kernel
transposed the float32 tile: that run's ``*_delayed`` columns are it, its
``*_delayed_convert_first`` columns the FP8 transpose kept since.)

Usage: python benchmarks/cast_bench.py OUT.json [--tilings 64x64w4 128x64w8 ...]
       [--activation] [--shapes 8192x16384 ...]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plt

from jax_comm_gemm.fp8 import cast, prologue
from jax_comm_gemm.fp8.quantize import amax, inverse, scale_from_amax
from fp8_step import clocks  # beside this file

E4M3 = jnp.float8_e4m3fn
SHAPES = ((8192, 4096), (8192, 12288), (8192, 16384), (16384, 4096), (4096, 16384))


def variants(tilings, activation=False):
  interpret = jax.default_backend() != "gpu"  # a smoke run elsewhere
  def current(impl, tile=None):
    def f(x):
      scale = scale_from_amax(amax(x), E4M3)
      if impl == "xla":
        q, qT, _ = cast.cast_transpose(x, scale, E4M3, implementation="xla")
      else:
        q, qT, _, _ = cast._pallas((x,), scale.reshape(1), jnp.dtype(E4M3), True, True,
                                   False, False, tile, None, interpret=interpret)
      return q, qT, inverse(scale)
    return jax.jit(f)

  def delayed(impl, tile=None):
    def f(x, scale):
      if impl == "xla":
        return cast.cast_transpose(x, scale, E4M3, with_amax=True, implementation="xla")
      return cast._pallas((x,), scale.reshape(1), jnp.dtype(E4M3), True, True, True, False,
                          tile, None, interpret=interpret)[:3]
    return jax.jit(f)

  def transposed(impl, tile=None):  # a gathered FP8 operand's TN copy
    if impl == "xla":
      return jax.jit(lambda q: q.T)
    def f(q):
      b = lax.bitcast_convert_type(q, jnp.uint8)
      bT = cast._move(b, 1, tile, interpret=interpret)
      return lax.bitcast_convert_type(bT, q.dtype)
    return jax.jit(f)

  out = {"xla_current": (current("xla"), "x"), "xla_delayed": (delayed("xla"), "x, scale"),
         "xla_transpose": (transposed("xla"), "q8"),
         # Delayed scaling's conditional amax: read (the first step) or skipped.
         "amax_if_read": (jax.jit(lambda x: cast.amax_if(x, True, implementation="pallas")), "x"),
         "amax_if_skip": (jax.jit(lambda x: cast.amax_if(x, False, implementation="pallas")),
                          "x")}
  for t in tilings:
    name = "pallas{}x{}w{}".format(*t)
    out[f"{name}_current"] = (current("pallas", t), "x")
    out[f"{name}_delayed"] = (delayed("pallas", t), "x, scale")
    out[f"{name}_transpose"] = (transposed("pallas", t), "q8")
    out[f"{name}_delayed_unclipped"] = (unclipped(t, interpret), "x, scale")
  if activation:  # the MLP's activation before the delayed cast of its output
    def with_prologue(prologue, tile=cast.PROLOGUE_TILING):
      return jax.jit(lambda x, scale: cast._pallas((x,), scale.reshape(1), jnp.dtype(E4M3),
                                                   True, True, True, False, tile, prologue,
                                                   interpret=interpret)[:3])
    out["gelu_two_passes"] = (jax.jit(lambda x, scale: delayed("pallas", cast.CAST_TILING)(
        prologue.activated(x, jax.nn.gelu), scale)), "x, scale")
    out["gelu_prologue"] = (with_prologue(jax.nn.gelu), "x, scale")
    if not interpret:  # the tanh of PTX's tanh.approx.f32 (no CPU lowering)
      out["gelu_prologue_approx_tanh"] = (with_prologue(_gelu_approx_tanh), "x, scale")
    # The MLP's backward: fc1's output gradient from (dh, pre) through GELU's
    # derivative, both copies, the amax and the column sums (b1's gradient).
    dgelu = prologue.activation_gradient(jax.nn.gelu)
    out["dgelu_two_passes"] = (jax.jit(lambda dh, x, scale: delayed(
        "pallas", cast.CAST_TILING)(prologue.activated((dh, x), dgelu), scale)), "dh, x, scale")
    for t in tilings:
      name = "pallas{}x{}w{}".format(*t)
      out[f"{name}_gelu_prologue"] = (with_prologue(jax.nn.gelu, t), "x, scale")
      out[f"{name}_dgelu_sums_prologue"] = (jax.jit(
          lambda dh, x, scale, t=t: cast._pallas((dh, x), scale.reshape(1), jnp.dtype(E4M3),
                                                 True, True, True, True, t, dgelu,
                                                 interpret=interpret)), "dh, x, scale")
  return out


def unclipped(tile, interpret):
  """The delayed cast as the kernel does it, but without its clip to the FP8
  range: the conversion's own saturation (PTX's cvt.rn.satfinite, where
  Triton emits it) in its place. Its bytes are checked against XLA's on a GPU
  (off one, NumPy's conversion overflows to NaN instead)."""
  from jax.experimental import pallas as pl
  tr, tc, warps = tile

  def kernel(scale_ref, x_ref, q_ref, qT_ref, a_ref):
    x = x_ref[...].astype(jnp.float32)
    q = (x * scale_ref[0]).astype(E4M3)
    q_ref[...] = q
    qT_ref[...] = q.T
    a_ref[...] = jnp.full((1, 1), cast._tile_amax(x), jnp.float32)

  def f(x, scale):
    r, c = x.shape
    grid = (r // tr, c // tc)
    return pl.pallas_call(
        kernel, grid=grid,
        out_shape=[jax.ShapeDtypeStruct((r, c), E4M3), jax.ShapeDtypeStruct((c, r), E4M3),
                   jax.ShapeDtypeStruct(grid, jnp.float32)],
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((tr, tc), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((tr, tc), lambda i, j: (i, j)),
                   pl.BlockSpec((tc, tr), lambda i, j: (j, i)),
                   pl.BlockSpec((1, 1), lambda i, j: (i, j))],
        interpret=interpret, compiler_params=plt.CompilerParams(num_warps=warps))(
            scale.reshape(1), x)
  return jax.jit(f)


def _gelu_approx_tanh(x):
  """jax.nn.gelu's tanh form with Triton's one-instruction tanh."""
  return 0.5 * x * (1 + plt.approx_tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x * x * x)))


def same_bytes(a, b):
  """The same bytes, every NaN counted as one (which encoding is XLA's choice)."""
  as_bytes = lambda t: jnp.where(jnp.isnan(t.astype(jnp.float32)), 0xFF,
                                 lax.bitcast_convert_type(t, jnp.uint8))
  return bool(jnp.array_equal(as_bytes(a), as_bytes(b)))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out")
  p.add_argument("--tilings", nargs="+", default=["64x64w4", "128x128w4"],
                  metavar="RxCwW", help="kernel tilings: tile rows x columns, warps")
  p.add_argument("--activation", action="store_true",
                 help="also GELU before the delayed cast: in its own pass, as the kernel's "
                      "prologue, and (on a GPU) the prologue with PTX's approximate tanh")
  p.add_argument("--shapes", nargs="+", metavar="RxC", help="these shapes only")
  args = p.parse_args()
  tilings = [tuple(int(v) for v in t.replace("w", "x").split("x")) for t in args.tilings]
  shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes
            else SHAPES)
  vs = variants(tilings, args.activation)
  results = {"meta": {"jax": jax.__version__, "device": jax.devices()[0].device_kind}}
  before = clocks()
  for shape in shapes:
    x = (jax.random.normal(jax.random.key(1), shape, jnp.float32) * 3).astype(jnp.bfloat16)
    scale = jnp.float32(37.0)
    dh = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    ref = vs["xla_delayed"][0](x, scale)
    bad = x.at[5, 7].set(jnp.inf).at[9, 11].set(jnp.nan)
    ref_bad = vs["xla_delayed"][0](bad, scale)
    q8 = ref[0]
    checks = {}
    for t in tilings:
      name = "pallas{}x{}w{}".format(*t)
      got = vs[f"{name}_delayed"][0](x, scale)
      got_bad = vs[f"{name}_delayed"][0](bad, scale)
      checks[name] = (same_bytes(got[0], ref[0]) and same_bytes(got[1], ref[1])
                   and bool(got[2] == ref[2]) and same_bytes(got_bad[0], ref_bad[0])
                   and same_bytes(got_bad[1], ref_bad[1]) and bool(jnp.isnan(got_bad[2]))
                   and same_bytes(vs[f"{name}_transpose"][0](q8), q8.T))
      if jax.default_backend() == "gpu":  # the conversion's own saturation
        unclipped_bad = vs[f"{name}_delayed_unclipped"][0](bad, scale)
        checks[f"{name}_unclipped"] = (
            same_bytes(vs[f"{name}_delayed_unclipped"][0](x, scale)[1], ref[1])
            and same_bytes(unclipped_bad[0], ref_bad[0])
            and same_bytes(unclipped_bad[1], ref_bad[1]))
    times = {n: [] for n in vs}
    t_end = time.perf_counter() + 2.0
    while time.perf_counter() < t_end:  # load
      jax.block_until_ready(vs["xla_current"][0](x))
    names = list(vs)
    for rnd in range(10):
      for n in (names if rnd % 2 == 0 else names[::-1]):
        f, kind = vs[n]
        argv = {"x": (x,), "x, scale": (x, scale), "q8": (q8,),
                "dh, x, scale": (dh, x, scale)}[kind]
        jax.block_until_ready(f(*argv))
        t0 = time.perf_counter()
        for _ in range(20):
          out = f(*argv)
        jax.block_until_ready(out)
        times[n].append((time.perf_counter() - t0) / 20)
    key = f"{shape[0]}x{shape[1]}"
    results[key] = {n: 1e6 * float(np.median(v)) for n, v in times.items()}
    results[key]["bit_exact"] = all(v for n, v in checks.items() if "unclipped" not in n)
    results[key]["checks"] = checks
    print(key, results[key], flush=True)
  results["meta"].update(clocks_before=before, clocks_after=clocks())
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  print(f"\n{results['meta']['device']}, jax {jax.__version__}; clocks {before} -> "
        f"{results['meta']['clocks_after']}")
  names = list(vs)
  print("| shape | " + " | ".join(f"{n} us" for n in names) + " | bit-exact |")
  print("| --- " * (len(names) + 2) + "|")
  for shape in shapes:
    r = results[f"{shape[0]}x{shape[1]}"]
    print(f"| {shape[0]}x{shape[1]} | " + " | ".join(f"{r[n]:.1f}" for n in names)
          + f" | {r['bit_exact']} |")


if __name__ == "__main__":
  main()
