"""Checks that need one GPU and the built extension, no collective: the FP8
GEMM custom call (xla_ffi/fp8_gemm.cc) and the FP8 layers on it at tp = 1,
then the fused FP8 comm-GEMMs on a group of one (one_rank.py).

Run by tests/gpu/test_one_gpu.py in a process of its own (the pytest process is
pinned to the CPU), or directly: ``python tests/gpu/one_gpu.py [WORD ...]``
(only the checks whose names contain a WORD). Prints one
line per check and ``one_gpu: N ok, M failed`` last; exits 1 on a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_comm_gemm as jcg  # noqa: E402
import one_rank  # noqa: E402  (beside this file)
from jax_comm_gemm.fp8 import (Fp8Recipe, fp8_all_gather_matmul,  # noqa: E402
                               fp8_matmul_reduce_scatter, quantize_rows, quantize_tensor)
from jax_comm_gemm.fp8.quantize import BLOCK, dequantize, quantize_blocks  # noqa: E402
from jax_comm_gemm.fp8.gemm import cublaslt_gemm_tn, fp8_gemm_tn  # noqa: E402
from jax_comm_gemm.runtime.constants import TARGETS  # noqa: E402

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
TARGET = TARGETS["fp8_gemm"]


def _operands(m, n, k, da, db, scaling, seed):
  ka, kb = jax.random.split(jax.random.key(seed))
  # Rows of very different magnitudes: a per-row scale that is missing,
  # swapped or applied to the wrong axis shows at once.
  a = jax.random.normal(ka, (m, k)) * jnp.exp2(jnp.arange(m) % 7)[:, None]
  b = jax.random.normal(kb, (n, k)) * jnp.exp2(-(jnp.arange(n) % 5))[:, None]
  quantize = quantize_rows if scaling == "row" else quantize_tensor
  (a8, ia), (b8, ib) = quantize(a, da), quantize(b, db)
  return a8, b8, ia, ib


def _reference(a8, b8, ia, ib):
  """float64 of the dequantized operands' product."""
  ia, ib = np.asarray(ia, np.float64), np.asarray(ib, np.float64)
  a = np.asarray(a8.astype(jnp.float32), np.float64) * (ia[:, None] if ia.ndim else ia)
  b = np.asarray(b8.astype(jnp.float32), np.float64) * (ib[:, None] if ib.ndim else ib)
  return a @ b.T


def _row_error(got, ref) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return float(np.max(np.abs(got - ref).max(1) / np.maximum(np.abs(ref).max(1), 1e-30)))


# The FP8 tensor cores' own accumulation error (relative to a row's largest
# output) on top of the output's rounding: partial sums are promoted to f32
# periodically, or with fast accumulation not at all (measured on one H200:
# this check prints the worst of each).
ACCUMULATION_TOL = {False: 2e-3, True: 3e-2}


def check_gemm_against_float64():
  """Every operand type pair, both scalings, bf16 and f32 out, timed and not,
  fast accumulation and not: the custom call per row against float64 of the
  dequantized operands (a wrong or missing scale is off by a power of two)."""
  worst = {}
  for (m, n, k) in ((256, 384, 512), (200, 96, 256), (1024, 2048, 4096)):
    for da, db in ((E4, E4), (E5, E4), (E4, E5)):
      for scaling in ("tensor", "row"):
        a8, b8, ia, ib = _operands(m, n, k, da, db, scaling, m + n + k)
        ref = _reference(a8, b8, ia, ib)
        for out, rounding in ((jnp.bfloat16, 2.0 ** -8), (jnp.float32, 0.0)):
          for timed in (True, False):
            for fast in (True, False):
              got = cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=out, timed=timed,
                                   fast_accum=fast)
              assert got.dtype == out and got.shape == (m, n)
              err = _row_error(got, ref)
              key = (m, n, k, jnp.dtype(da).name, jnp.dtype(db).name, scaling,
                     jnp.dtype(out).name, timed, fast)
              tol = rounding + ACCUMULATION_TOL[fast]
              assert err <= tol, f"{key}: per-row error {err:.3g} > {tol:.3g}"
              group = f"{jnp.dtype(out).name} {'fast' if fast else 'precise'}"
              worst[group] = max(worst.get(group, 0.0), err)
  return "worst per-row error: " + ", ".join(f"{g} {e:.2e}" for g, e in sorted(worst.items()))


def check_block_gemm_against_float64():
  """Block scales ("block" scaling): 1 x 128 blocks of a against 128 x 128 of b
  (a layer's forward and input gradient), 1 x 128 against 1 x 128 (its weight
  gradient), every operand-type pair, bf16 and f32 out, timed and not: the
  custom call per row against float64 of the dequantized operands. Each
  block's scale differs by a power of two, so a scale read from the wrong
  block (a wrong layout) is off by a factor of 2 or more."""
  worst = {}
  for (m, n, k) in ((256, 384, 512), (1024, 2048, 4096), (128, 256, 384)):
    for da, db in ((E4, E4), (E5, E4), (E4, E5)):
      for b_rows in (BLOCK, 1):
        ka, kb = jax.random.split(jax.random.key(m + k + b_rows))
        ramp = lambda r, c, p: jnp.exp2((jnp.arange(r)[:, None] // p + jnp.arange(c)[None, :]
                                         // BLOCK) % 6 - 3)
        a = jax.random.normal(ka, (m, k)) * ramp(m, k, 1)
        b = jax.random.normal(kb, (n, k)) * ramp(n, k, b_rows)
        (a8, ia), (b8, ib) = quantize_blocks(a, da, 1), quantize_blocks(b, db, b_rows)
        ref = (np.asarray(dequantize(a8, ia), np.float64)
               @ np.asarray(dequantize(b8, ib), np.float64).T)
        for out in (jnp.bfloat16, jnp.float32):
          for timed in (True, False):
            got = cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=out, timed=timed, fast_accum=False)
            err = _row_error(got, ref)
            key = (m, n, k, jnp.dtype(da).name, jnp.dtype(db).name, b_rows,
                   jnp.dtype(out).name, timed)
            tol = (2.0 ** -8 if out == jnp.bfloat16 else 0.0) + ACCUMULATION_TOL[False]
            assert err <= tol, f"{key}: per-row error {err:.3g} > {tol:.3g}"
            group = f"{'1x128' if b_rows == 1 else '128x128'} b, {jnp.dtype(out).name}"
            worst[group] = max(worst.get(group, 0.0), err)
  return "worst per-row error: " + ", ".join(f"{g} {e:.2e}" for g, e in sorted(worst.items()))


def check_gemm_hlo():
  """fp8_gemm_tn(form="cublaslt") compiles to the one custom call: no XLA GEMM,
  no transpose; the "direct" form stays XLA's."""
  a8, b8, ia, ib = _operands(512, 256, 1024, E4, E4, "tensor", 1)
  text = jax.jit(lambda *t: fp8_gemm_tn(*t, jnp.bfloat16, form="cublaslt")).lower(
      a8, b8, ia, ib).compile().as_text()
  calls = text.count(f'custom_call_target="{TARGET}"')
  assert calls == 1, f"{calls} calls of {TARGET}"
  assert "__cublas$lt$matmul" not in text and " transpose(" not in text, text[:2000]
  direct = jax.jit(lambda *t: fp8_gemm_tn(*t, jnp.bfloat16)).lower(
      a8, b8, ia, ib).compile().as_text()
  assert TARGET not in direct
  # The direct form without fast accumulation (Precision.HIGHEST) must stay
  # an FP8 GEMM, not an upcast one.
  precise = jax.jit(lambda *t: fp8_gemm_tn(*t, jnp.bfloat16, fast_accum=False)).lower(
      a8, b8, ia, ib).compile().as_text()
  f8 = precise.count('custom_call_target="__cublas$lt$matmul$f8"')
  triton = precise.count("__triton_gemm")
  assert f8 + triton == 1 and 'custom_call_target="__cublas$lt$matmul"' not in precise, (
      precise[:3000])
  return ("one custom call, no XLA GEMM, no transpose; direct form without fast "
          f"accumulation: {'cuBLASLt FP8' if f8 else 'Triton'} GEMM")


def check_gemm_error_reaches_python():
  """A buffer the handler refuses gives a Python error with its message."""
  a8, b8, ia, ib = _operands(64, 32, 64, E4, E4, "tensor", 2)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((64, 33), jnp.bfloat16))
  try:
    jax.block_until_ready(jax.jit(lambda *t: call(
        *t, timed=True, fast_accum=True, a_scale_mode=np.int32(0), b_scale_mode=np.int32(0)))(
            a8, b8, ia, ib))
  except Exception as e:  # XlaRuntimeError (its module moved between jax versions)
    assert "d has shape [64, 33], expected [64, 32]" in str(e), str(e)
    return f"{type(e).__name__}: ...{str(e)[-60:]}"
  raise AssertionError("a wrong result shape was not refused")


def _gpu_memory_used_mib() -> int:
  out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                        "-i", "0"], capture_output=True, text=True, check=True).stdout
  return int(out.split()[0])


def check_gemm_workspace_per_call_site():
  """Each call site keeps only the workspace its algorithm needs: 24 call
  sites, timed at their first call (32 MiB of trial workspace each, freed),
  must not hold 24 x 32 MiB after it."""
  sites = 24
  a8, b8, ia, ib = _operands(2048, 1024, 4096, E4, E4, "tensor", 5)

  def many(a8, b8, ia, ib):
    out = jnp.zeros((2048, 1024), jnp.float32)
    for i in range(sites):  # distinct operands: XLA cannot merge the calls
      out = out + cublaslt_gemm_tn(a8, b8, ia * (i + 1), ib, out_dtype=jnp.float32)
    return out

  f = jax.jit(many).lower(a8, b8, ia, ib).compile()
  before = _gpu_memory_used_mib()
  jax.block_until_ready(f(a8, b8, ia, ib))
  held = _gpu_memory_used_mib() - before
  assert held < sites * 8, f"{sites} FP8 GEMM call sites hold {held} MiB after their first call"
  return f"{sites} call sites hold {held} MiB after their timed first call"


def _mlp_inputs(seed, n, k, m):
  """x [n, k] bf16 and an MLP's two f32 weights, [k, m] and [m, k], ~ fan-in^-1/2."""
  kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (n, k), jnp.bfloat16)
  w1 = (jax.random.normal(kw, (k, m)) / np.sqrt(k)).astype(jnp.float32)
  w2 = (jax.random.normal(kc, (m, k)) / np.sqrt(m)).astype(jnp.float32)
  return x, w1, w2


def _relative_error(a, b) -> float:
  """``max|a - b| / max|b|`` in float64 (NaN where b is all zeros: no check passes)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def check_layers_tp1():
  """The FP8 layers at tp = 1 with gemm_form="cublaslt", forward and
  gradients, against the "direct" form (same quantization, so the same
  operands: equal up to the output's rounding) and float64 (FP8 tolerances)."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 512, 1024, 768
  x, w1, w2 = _mlp_inputs(3, n, k, m)
  out = []
  for scaling in ("tensor", "row", "block"):
    results = {}
    for form in ("cublaslt", "direct"):
      recipe = Fp8Recipe(scaling=scaling, gemm_form=form)

      def layers(x, w1, w2, recipe=recipe):
        h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe)
        return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe)

      mlp = jax.shard_map(layers, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                          out_specs=P("tp"))
      # An argument, not a constant: XLA would fold the constant cotangent's
      # amax at compile time, seconds per program.
      weights = jnp.cos(jnp.arange(k, dtype=jnp.float32))
      f = jax.jit(jax.value_and_grad(
          lambda x, w1, w2, weights: jnp.sum(mlp(x, w1, w2).astype(jnp.float32) * weights),
          argnums=(0, 1, 2)))
      results[form] = jax.block_until_ready(f(x, w1, w2, weights))
      if form == "cublaslt":
        hlo = f.lower(x, w1, w2, weights).compile().as_text()
        calls = hlo.count(f'custom_call_target="{TARGET}"')
        assert calls == 6, f"{scaling}: {calls} FP8 custom calls, expected 6 (3 per layer)"
    (_, gc), (_, gd) = results["cublaslt"], results["direct"]
    errs = []
    # Not the loss: a sum with cancellations, its relative error says nothing.
    for name, a, b in (("dx", gc[0], gd[0]), ("dw1", gc[1], gd[1]), ("dw2", gc[2], gd[2])):
      err = _relative_error(a, b)
      errs.append(f"{name} {err:.1e}")
      # The forms differ in rounding (and so in what E5M2 rounds to after):
      # within the forward's FP8 tolerance; a wrong scale is off by >= 0.5.
      assert err < 0.106, f"{scaling} {name}: cublaslt vs direct {err:.3g}"
    # fc1's output against float64 (FP8's own error, docs/fp8.md's bound).
    h = jax.jit(jax.shard_map(
        lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=Fp8Recipe(
            scaling=scaling, gemm_form="cublaslt")),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))(x, w1)
    ref = np.asarray(x, np.float64) @ np.asarray(w1, np.float64)
    rel = float(np.max(np.abs(np.asarray(h, np.float64) - ref)) / np.max(np.abs(ref)))
    assert rel < 0.106, f"{scaling}: fc1 output off float64 by {rel:.3g}"
    errs.append(f"fc1 vs float64 {rel:.1e}")
    out.append(f"{scaling}: " + ", ".join(errs))
  return "; ".join(out)


def check_fused_casts():
  """The one-pass cast kernel compiled: its bytes equal XLA's casts (with inf,
  NaN and saturation planted), and the FP8 layers at tp = 1 inside
  shard_map(check_vma=True) give the same outputs and gradients with it as
  with XLA's casts, its kernels in the HLO."""
  from jax_comm_gemm.fp8 import cast
  x = (jax.random.normal(jax.random.key(5), (1024, 768)) * 300).astype(jnp.bfloat16)
  x = x.at[1, 2].set(jnp.inf).at[700, 9].set(jnp.nan)
  # Bytes, each NaN as one (E5M2 has three NaN encodings; which one is XLA's choice).
  as_bytes = lambda a: np.where(np.isnan(np.asarray(a, np.float32)), 0xFF,
                                np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)))
  for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    for copies in (dict(), dict(columns=False)):  # both copies, or rows and the amax
      got = cast.cast_transpose(x, 1.5, f8, with_amax=True, implementation="pallas", **copies)
      want = cast.cast_transpose(x, 1.5, f8, with_amax=True, implementation="xla", **copies)
      for g, w in zip(got[:2], want[:2]):
        assert (g is None) == (w is None)
        if g is not None:
          np.testing.assert_array_equal(as_bytes(g), as_bytes(w))
      assert np.isnan(float(got[2])), got[2]
    np.testing.assert_array_equal(as_bytes(cast.transpose(want[0], implementation="pallas")),
                                  as_bytes(want[0].T))
  # A LayerNorm inside the cast: its row statistics as [r, 1] operands.
  from jax_comm_gemm.fp8 import prologue
  from jax_comm_gemm.layers.transformer import normalization
  y = x.at[1, 2].set(3.0).at[700, 9].set(-2.0) / 300 + jnp.arange(1024)[:, None] % 7
  ops = normalization(y, {"scale": jnp.linspace(0.5, 2, 768), "bias": jnp.cos(jnp.arange(768.0))},
                      1e-6, jnp.bfloat16)
  got, want = (cast.cast_transpose(ops, 1.5, jnp.float8_e4m3fn, with_amax=True,
                                   implementation=i, prologue=prologue.layer_norm)
               for i in ("pallas", "xla"))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(as_bytes(g), as_bytes(w))
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 1024, 512, 768
  xs, w1, w2 = _mlp_inputs(6, n, k, m)
  weights = jnp.cos(jnp.arange(k, dtype=jnp.float32))
  results = {}
  for casts in ("fused", "xla"):
    recipe = Fp8Recipe(casts=casts)

    def layers(x, w1, w2, recipe=recipe):
      h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe)
      return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe)
    mlp = jax.shard_map(layers, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                        out_specs=P("tp"))
    f = jax.jit(jax.value_and_grad(
        lambda x, w1, w2, c: jnp.sum(mlp(x, w1, w2).astype(jnp.float32) * c), argnums=(0, 1, 2)))
    results[casts] = jax.block_until_ready(f(xs, w1, w2, weights))
    kernels = f.lower(xs, w1, w2, weights).compile().as_text().count("fp8_cast_")
    assert (kernels > 0) == (casts == "fused"), f"casts={casts}: {kernels} cast kernels"
  errs = []
  for name, a, b in zip(("dx", "dw1", "dw2"), results["fused"][1], results["xla"][1]):
    err = _relative_error(a, b)
    assert err < 1e-2, f"{name}: fused casts vs XLA's {err:.3g}"  # same bytes, other layouts
    errs.append(f"{name} {err:.1e}")
  return ("bytes equal XLA's (E4M3, E5M2, transpose, LayerNorm's); layers: "
          + ", ".join(errs))


def check_delayed_casts():
  """Delayed scaling on the kernels compiled: the conditional amax (NaN, inf,
  wanted or not) equals XLA's, and an MLP at tp = 1 inside
  shard_map(check_vma=True), at its first step and after, gives the same
  outputs, gradients and next histories as on XLA's passes."""
  from jax_comm_gemm.fp8 import AmaxHistory, cast, prologue
  x = (jax.random.normal(jax.random.key(7), (1024, 768)) * 30).astype(jnp.bfloat16)
  for planted in (x, x.at[3, 4].set(jnp.inf), x.at[900, 700].set(jnp.nan)):
    for wanted in (True, False):
      got = cast.amax_if(planted, jnp.bool_(wanted), implementation="pallas")
      want = cast.amax_if(planted, jnp.bool_(wanted), implementation="xla")
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 1024, 512, 768
  xs, w1, w2 = _mlp_inputs(8, n, k, m)
  # A random cotangent: one constant per column (cos(feature), as elsewhere)
  # would make a rounding that XLA's fusion and the kernel take differently
  # flip a whole column of the weight gradient at once.
  weights = jax.random.normal(jax.random.key(9), (n, k), jnp.float32)
  errs = []
  # The first step (empty histories), then the next on the histories the
  # first handed out (XLA's passes'), as training runs.
  histories = (AmaxHistory.zeros(Fp8Recipe("delayed", amax_history=4)),) * 2
  for steady in (False, True):
    results = {}
    for casts in ("fused", "xla"):
      recipe = Fp8Recipe("delayed", amax_history=4, casts=casts)

      def layers(x, w1, w2, h1, h2, recipe=recipe):
        h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=h1)
        return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe, history=h2)
      mlp = jax.shard_map(layers, mesh=mesh, out_specs=P("tp"),
                          in_specs=(P("tp"), P(None, "tp"), P("tp"), P(), P()))
      f = jax.jit(jax.value_and_grad(
          lambda *a: jnp.sum(mlp(*a[:5]).astype(jnp.float32) * a[5]), argnums=(0, 1, 2, 3, 4)))
      results[casts] = jax.block_until_ready(f(xs, w1, w2, *histories, weights))
      hlo = f.lower(xs, w1, w2, *histories, weights).compile().as_text()
      kernels = hlo.count("fp8_amax_if")
      assert (kernels > 0) == (casts == "fused"), f"casts={casts}: {kernels} amax kernels"
    fused, plain = results["fused"][1], results["xla"][1]
    for name, a, b in zip(("dx", "dw1", "dw2"), fused[:3], plain[:3]):
      err = _relative_error(a, b)
      # XLA may cast (and take the amax of) a gradient its fusion has not yet
      # rounded to bf16 (excess precision), the kernel reads the bf16 tensor:
      # E5M2 rounds some values the other way. Within the forward's FP8
      # tolerance (check_layers_tp1); a wrong scale is off by >= 0.5.
      step = "steady" if steady else "first"
      assert err < 0.106, f"{step} step, {name}: kernels vs XLA's {err:.3g}"
      errs.append(f"{step} {name} {err:.1e}")
    for h_fused, h_plain in zip(fused[3:], plain[3:]):
      np.testing.assert_array_equal(h_fused.w, h_plain.w)  # maxima of the weights: exact
      # fc2's input and the gradients are fusions' outputs: up to that bf16 rounding.
      np.testing.assert_allclose(h_fused.x, h_plain.x, rtol=2.0 ** -7)
      np.testing.assert_allclose(h_fused.dy, h_plain.dy, rtol=2.0 ** -7)
    histories = tuple(plain[3:])
  return "amax_if equals XLA's; histories equal; " + ", ".join(errs)


def check_activation_casts():
  """The cast kernel with the MLP's activation as its prologue, compiled:
  its codes against float64's GELU rounded to bf16 and cast (the exact
  answer), at most one step off and few (a tanh's last bits flip a bf16
  rounding now and then; XLA's own fused cast is reported beside it), its amax that output's; and an FP8 MLP at tp = 1 with the
  activation inside fc2's cast (delayed and tensor) gives the gradients of
  the activation applied before the op."""
  from jax_comm_gemm.fp8 import AmaxHistory, cast, prologue
  x = (jax.random.normal(jax.random.key(9), (1024, 768)) * 3).astype(jnp.bfloat16)
  x64 = np.asarray(x, np.float64)
  c = np.sqrt(2 / np.pi)
  exact = jnp.asarray(0.5 * x64 * (1 + np.tanh(c * (x64 + 0.044715 * x64 ** 3))), jnp.float32)
  exact = exact.astype(jnp.bfloat16)  # the activation's output as its op would round it
  codes = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(np.int16)
  notes = []
  for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    want = cast.cast_transpose(exact, 40.0, f8, with_amax=True, implementation="xla")
    got = cast.cast_transpose(x, 40.0, f8, with_amax=True, implementation="pallas",
                              prologue=jax.nn.gelu)
    xla = jax.jit(lambda x: cast.cast_transpose(x, 40.0, f8, implementation="xla",
                                                prologue=jax.nn.gelu))(x)
    for g, w in zip(got[:2], want[:2]):
      diff = np.abs(codes(g) - codes(w))
      # E5M2's midpoints are bf16 values: a tanh's last bits move 0.9% of its
      # codes on CPU (XLA's as the kernel's).
      assert diff.max() <= 1 and np.mean(diff > 0) <= 2e-2, (diff.max(), np.mean(diff > 0))
    off = lambda q: np.mean(codes(q) != codes(want[0]))
    xla_diff = np.abs(codes(xla[0]) - codes(want[0])).max()
    notes.append(f"{np.dtype(f8).name}: kernel {off(got[0]):.2%} of codes off, XLA "
                 f"{off(xla[0]):.2%} (at most {xla_diff})")
    assert abs(float(got[2]) - float(want[2])) <= 1e-2 * float(want[2]), (got[2], want[2])
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 1024, 512, 768
  xs, w1, w2 = _mlp_inputs(10, n, k, m)
  ct = jax.random.normal(jax.random.key(11), (n, k), jnp.float32)  # a random cotangent
  for scaling in ("tensor", "delayed"):
    recipe = Fp8Recipe(scaling)
    results = {}
    for inside in (True, False):
      def layers(x, w1, w2, *h, inside=inside):
        hs = [{"history": AmaxHistory(*t)} for t in h] or [{}, {}]
        y = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, **hs[0])
        if inside:
          return fp8_matmul_reduce_scatter(y, w2, "tp", recipe=recipe, activation=jax.nn.gelu,
                                           **hs[1])
        return fp8_matmul_reduce_scatter(jax.nn.gelu(y), w2, "tp", recipe=recipe, **hs[1])
      h = [tuple(AmaxHistory.zeros(recipe))] * 2 if scaling == "delayed" else []
      mlp = jax.shard_map(layers, mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp"), P("tp")) + (P(),) * len(h),
                          out_specs=P("tp"))
      f = jax.jit(jax.value_and_grad(
          lambda x, w1, w2, c, *h: jnp.sum(mlp(x, w1, w2, *h).astype(jnp.float32) * c),
          argnums=(0, 1, 2)))
      results[inside] = jax.block_until_ready(f(xs, w1, w2, ct, *h))
    for name, a, b in zip(("dx", "dw1", "dw2"), results[True][1], results[False][1]):
      err = _relative_error(a, b)
      # The forward's FP8 tolerance (check_delayed_casts): the two round the
      # activation's output alike but for XLA's excess precision before the op.
      assert err < 0.106, f"{scaling} {name}: activation inside vs before the op {err:.3g}"
      notes.append(f"{scaling} {name} {err:.1e}")
  return "; ".join(notes)


def check_gradient_casts():
  """fc1's output gradient made inside its cast, compiled: the kernel's
  (dh, pre) -> GELU'-weighted FP8 codes against float64's derivative rounded
  to bf16 and cast (at most one step off, and few), its amax and column sums
  (b1's gradient) against float64; and ``fp8_mlp`` at tp = 1 (delayed, bias)
  against the two ops it replaces, loss and every gradient."""
  from jax_comm_gemm.fp8 import AmaxHistory, cast, fp8_mlp, prologue
  k1, k2 = jax.random.split(jax.random.key(12))
  dh = jax.random.normal(k1, (1024, 768), jnp.bfloat16)
  pre = (jax.random.normal(k2, (1024, 768)) * 3).astype(jnp.bfloat16)
  d64, p64 = np.asarray(dh, np.float64), np.asarray(pre, np.float64)
  c = np.sqrt(2 / np.pi)
  t = np.tanh(c * (p64 + 0.044715 * p64 ** 3))
  exact64 = d64 * (0.5 * (1 + t) + 0.5 * p64 * (1 - t ** 2) * c * (1 + 3 * 0.044715 * p64 ** 2))
  exact = jnp.asarray(exact64, jnp.float32).astype(jnp.bfloat16)

  def codes(a):  # FP8 codes in value order (sign-magnitude to signed; -0 and +0 alike)
    c = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(np.int16)
    return np.where(c & 0x80, -(c & 0x7F), c)
  grad = prologue.activation_gradient(jax.nn.gelu)
  notes = []
  # XLA computing the same float32 derivative (jax.nn.gelu's), rounded to bf16:
  # float64's differs from it where float32's 1 + tanh cancels (pre << 0).
  same = jax.jit(lambda a, b: prologue.activated((a, b), grad))(dh, pre)
  for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    want = cast.cast_transpose(same, 40.0, f8, with_amax=True, implementation="xla")
    got = cast.cast_transpose((dh, pre), 40.0, f8, with_amax=True, with_column_sums=True,
                              implementation="pallas", prologue=grad)
    # Triton's tanh and XLA's differ in their last bits, which moves a bf16
    # rounding now and then: at most one FP8 step apart, and few. Where float32's
    # 1 + tanh cancels (pre << 0) both are noise far below the amax: there only
    # the value counts, within 1e-3 of the amax.
    floor = 1e-3 * 40.0 * float(want[2])
    for g, w in zip(got[:2], want[:2]):
      diff = np.abs(codes(g) - codes(w))
      gv, wv = (np.asarray(a, np.float64) for a in (g, w))
      far = (diff > 1) & (np.abs(gv - wv) > floor)
      assert not far.any() and np.mean(diff > 0) <= 2e-2, (
          f"{np.dtype(f8).name}: {far.sum()} codes more than one step off XLA's and "
          f"{np.abs(gv - wv)[far].max() if far.any() else 0:.3g} apart (floor {floor:.3g}); "
          f"{np.mean(diff > 0):.2%} off")
    assert abs(float(got[2]) - float(want[2])) <= 1e-2 * float(want[2]), (got[2], want[2])
    sums_err = _relative_error(got[3], exact64.sum(0))
    assert sums_err < 1e-2, f"column sums against float64 {sums_err:.3g}"
    exact_off = np.mean(codes(cast.cast_transpose(exact, 40.0, f8, implementation="xla")[0])
                        != codes(got[0]))
    notes.append(f"{np.dtype(f8).name}: {np.mean(codes(got[0]) != codes(want[0])):.2%} of "
                 f"codes off XLA's ({exact_off:.2%} off float64's), sums {sums_err:.1e}")
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 1024, 512, 768
  xs, w1, w2 = _mlp_inputs(13, n, k, m)
  b1 = (jax.random.normal(jax.random.key(14), (m,)) * 0.5).astype(jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(15), (n, k), jnp.float32)
  recipe = Fp8Recipe("delayed")
  results = {}
  for one_op in (True, False):
    def layers(x, w1, b1, w2, h1, h2, one_op=one_op):
      h1, h2 = AmaxHistory(*h1), AmaxHistory(*h2)
      if one_op:
        return fp8_mlp(x, w1, b1, w2, "tp", activation=jax.nn.gelu, recipe=recipe,
                       histories=(h1, h2))
      y = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=h1) + b1
      return fp8_matmul_reduce_scatter(y, w2, "tp", recipe=recipe, activation=jax.nn.gelu,
                                       history=h2)
    h = [tuple(AmaxHistory.zeros(recipe))] * 2
    mlp = jax.shard_map(layers, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"),
                                                     P("tp"), P(), P()), out_specs=P("tp"))
    def loss(x, w1, b1, w2, c, *h, mlp=mlp):
      y = mlp(x, w1, b1, w2, *h)
      return jnp.sum(y.astype(jnp.float32) * c), y
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    results[one_op] = jax.block_until_ready(f(xs, w1, b1, w2, ct, *h))
  # The output itself, not the loss: sum(y * c) cancels to ~0.2% of sum|y * c|,
  # so its relative difference says little (on CPU: 0.9% for the same
  # arithmetic, 84% with b1 left out). y: 2.8% on CPU, 42% with b1 left out.
  err = _relative_error(results[True][0][1], results[False][0][1])
  assert err < 0.08, f"y: one op vs the two ops {err:.3g}"
  notes.append(f"y {err:.1e}")
  for name, a, b in zip(("dx", "dw1", "db1", "dw2"), results[True][1], results[False][1]):
    err = _relative_error(a, b)
    # As check_activation_casts: the same FP8 arithmetic but for XLA's excess
    # precision in the two ops' derivative (f32 into the cast, not bf16).
    assert err < 0.106, f"{name}: one op vs the two ops {err:.3g}"
    notes.append(f"{name} {err:.1e}")
  return "; ".join(notes)


def check_gated_casts():
  """The gated MLP's product inside the casts, compiled: the kernel that reads
  gate's and up's halves of one [r, 2c] operand (forward: silu(g) * u) and the
  one that writes the pair [d gate, d up] from (dy, gate|up) give XLA's codes
  for the same arithmetic (at most one step off, and few: Triton's exp and
  XLA's differ in their last bits), their amaxes and column sums; and the
  Llama block's MLP under delayed FP8 at tp = 1, the one op (its kernels in
  the HLO) against the product in XLA's passes, output and every gradient."""
  from jax_comm_gemm.fp8 import cast, prologue
  from jax_comm_gemm.layers import dense, gated_mlp
  k1, k2 = jax.random.split(jax.random.key(16))
  h = (jax.random.normal(k1, (1024, 2 * 768)) * 2).astype(jnp.bfloat16)
  dy = jax.random.normal(k2, (1024, 768), jnp.bfloat16)
  glu = prologue.gated(jax.nn.silu)

  def codes(a):  # FP8 codes in value order (sign-magnitude to signed)
    c = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(np.int16)
    return np.where(c & 0x80, -(c & 0x7F), c)
  notes = []
  for f, operands in ((glu, h), (prologue.activation_gradient(glu), (dy, h))):
    for f8 in (E4, E5):
      got, want = (cast.cast_transpose(operands, 20.0, f8, with_amax=True,
                                        with_column_sums=True, implementation=i, prologue=f)
                   for i in ("pallas", "xla"))
      for g, w in zip(got[:2], want[:2]):
        assert g.shape == w.shape, (g.shape, w.shape)
        diff = np.abs(codes(g) - codes(w))
        assert diff.max() <= 1 and np.mean(diff > 0) <= 2e-2, (
            f"{f.__name__} {np.dtype(f8).name}: {np.mean(diff > 0):.2%} of codes off XLA's, "
            f"up to {diff.max()} steps")
      assert abs(float(got[2]) - float(want[2])) <= 1e-2 * float(want[2]), (got[2], want[2])
      sums_err = _relative_error(got[3], want[3])
      assert sums_err < 1e-2, f"{f.__name__}: column sums {sums_err:.3g}"
      notes.append(f"{f.__name__} {np.dtype(f8).name}: "
                   f"{np.mean(codes(got[0]) != codes(want[0])):.2%} of codes off XLA's")
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  n, k, m = 1024, 512, 768
  xs = jax.random.normal(jax.random.key(17), (n, k), jnp.bfloat16)
  w1 = (jax.random.normal(jax.random.key(18), (k, 2, m)) / np.sqrt(k) * 2).astype(jnp.bfloat16)
  w2 = (jax.random.normal(jax.random.key(19), (m, k)) / np.sqrt(m)).astype(jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(20), (n, k), jnp.float32)
  config = jcg.CommGemmConfig(fp8=Fp8Recipe("delayed"))
  results = {}
  for inside in (True, False):
    mlp = jax.shard_map(lambda x, a, b, hs: gated_mlp.gated_mlp(
        x, a, b, axis_name="tp", config=config, fp8_histories=hs), mesh=mesh,
        in_specs=(P("tp"), P(None, None, "tp"), P("tp"), P()), out_specs=P("tp"))

    def loss(x, a, b, hs, mlp=mlp):
      y = mlp(x, a, b, hs)
      return jnp.sum(y.astype(jnp.float32) * ct), y
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    hs = dense.init_mlp_fp8_histories(config)
    with mock.patch.object(gated_mlp, "product_inside",
                           lambda config, on=inside: on and config.fp8 is not None):
      results[inside] = jax.block_until_ready(f(xs, w1, w2, hs))
      kernels = f.lower(xs, w1, w2, hs).compile().as_text().count("swiglu")
    assert (kernels > 0) == inside, f"inside={inside}: {kernels} swiglu kernels"
  # Two FP8 programs of the same arithmetic but for XLA's bf16 passes (codes
  # may flip): within the forward's and the weight gradient's FP8 tolerance.
  err = _relative_error(results[True][0][1], results[False][0][1])
  assert err < 0.106, f"y: one op vs the product outside {err:.3g}"
  notes.append(f"y {err:.1e}")
  for name, a, b in zip(("dx", "d gate_up", "d down"), results[True][1], results[False][1]):
    err = _relative_error(a, b)
    assert err < 0.165, f"{name}: one op vs the product outside {err:.3g}"
    notes.append(f"{name} {err:.1e}")
  return "; ".join(notes)


def check_heads_casts():
  """Attention's layout inside the casts, compiled: cast_heads' bytes equal
  XLA's layout change then cast (inf, NaN, saturation planted; q, k, v and one
  part), the token-reordering FP8 transpose equals XLA's, and the block at
  tp = 1 gives the same loss and gradients with the ops taking the layout
  (cast_heads) as with XLA's copies outside them (the weight gradients sum
  their tokens in another order: bf16's rounding apart)."""
  from unittest import mock
  from jax_comm_gemm.fp8 import cast, heads
  from jax_comm_gemm.layers import dense, transformer as tb
  as_bytes = lambda a: np.where(np.isnan(np.asarray(a, np.float32)), 0xFF,
                                np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)))
  b, s, h, d = 4, 256, 4, 128
  parts = [(jax.random.normal(jax.random.key(i), (b, s, h, d)) * 300).astype(jnp.bfloat16)
           for i in range(3)]
  parts[1] = parts[1].at[2, 7, 1, 3].set(jnp.inf).at[0, 100, 3, 64].set(jnp.nan)
  for f8 in (E4, E5):
    for ps in (parts, parts[:1]):
      got, want = (heads.cast_heads(ps, 1.5, f8, with_amax=True, with_column_sums=True,
                                    implementation=i) for i in ("pallas", "xla"))
      for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(as_bytes(g), as_bytes(w))
      assert float(got[2]) == float(want[2]) or np.isnan(float(want[2])), (got[2], want[2])
      # the column sums (a bias's gradient): float32 sums in another order
      np.testing.assert_allclose(got[3], want[3], rtol=1e-4, atol=1.0, equal_nan=True)
    q = got[0]
    np.testing.assert_array_equal(as_bytes(cast.transpose(q, batch=b, implementation="pallas")),
                                  as_bytes(cast.transpose(q, batch=b, implementation="xla")))
  heads_n, width = 4, 512
  notes = []
  for scaling in ("tensor", "delayed"):
    options = tb.BlockOptions(num_heads=heads_n, dtype=jnp.bfloat16,
                              config=jcg.CommGemmConfig(fp8=Fp8Recipe(scaling)))
    layout = jax.tree.leaves(tb.param_layout(width, 4 * width, "tp"),
                             is_leaf=lambda v: isinstance(v, tb.ParamSpec))
    params = jax.tree.unflatten(
        jax.tree.structure(tb.param_layout(width, 4 * width, "tp"),
                           is_leaf=lambda v: isinstance(v, tb.ParamSpec)),
        [jax.random.normal(jax.random.key(10 + i), p.shape, jnp.bfloat16) * 0.05
         + (1.0 if len(p.shape) == 1 and i % 4 == 0 else 0.0) for i, p in enumerate(layout)])
    x = jax.random.normal(jax.random.key(4), (s, b, width), jnp.bfloat16)
    hs = tb.init_fp8_histories(options)

    def step(axis):  # an axis name of its own: the block's jit traces afresh
      def loss(p, x):
        y = tb.sharded_transformer_block(x, p, mesh=Mesh(np.array(jax.devices()[:1]), (axis,)),
                                         axis_name=axis, options=options, fp8_histories=hs)
        return jnp.mean(y.astype(jnp.float32) ** 2)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    inside = step("tp")
    with mock.patch.object(dense, "heads_inside", lambda config, dot_general: False):
      outside = step("tp_outside")
    # Per array, relative to its norm (a wrong layout is off by O(1)): 1e-2 (the
    # biases' gradients too: float32 column sums from the casts in both layouts).
    worst = 0.0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(inside),
                            jax.tree.leaves(outside)):
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      err = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
      assert err < 1e-2, f"{scaling} {jax.tree_util.keystr(path)}: {err:.3g}"
      worst = max(worst, err)
    notes.append(f"{scaling} {worst:.1e}")
  return "; ".join(notes)


CHECKS = [check_gemm_against_float64, check_block_gemm_against_float64, check_gemm_hlo,
          check_gemm_error_reaches_python,
          check_gemm_workspace_per_call_site, check_layers_tp1, check_fused_casts,
          check_activation_casts, check_gradient_casts, check_gated_casts,
          check_delayed_casts, check_heads_casts,
          *one_rank.CHECKS]


def main(words) -> int:
  status = jcg.cublasmp_status()
  print(f"devices {jax.devices()}, extension: {status}", flush=True)
  if not status.ok:
    print(f"one_gpu: 0 ok, 1 failed (the extension is unavailable: {status.reason})")
    return 1
  ok = failed = 0
  for check in [c for c in CHECKS if not words or any(w in c.__name__ for w in words)]:
    try:
      print(f"{check.__name__}: ok ({check()})", flush=True)
      ok += 1
    except Exception:  # report every check, then fail
      print(f"{check.__name__}: FAILED\n{traceback.format_exc()}", flush=True)
      failed += 1
  print(f"one_gpu: {ok} ok, {failed} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
