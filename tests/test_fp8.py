"""Numerics of the FP8 collective matmuls (jax_comm_gemm.fp8), on CPU.

Every case runs the op in ``jax.shard_map`` under ``jax.jit`` and
``jax.value_and_grad`` of a random linear loss, on 1, 2 and 4 simulated
devices, with fresh random inputs, against float64 numpy.

Tolerances (docs/fp8.md). The error metric is ``max|got - ref| / max|ref|``.
Rounding to an FP8 type with ``p`` mantissa bits has a relative error of at
most ``u = 2**-(p+1)``: E4M3 ``u4 = 1/16``, E5M2 ``u5 = 1/8``. Each term of a
GEMM over FP8 operands ``a``, ``b`` is then off by ``da + db``, independent
random errors of variance at most ``u**2/3`` each (uniform in ``[-u, u]``), so
the output's relative rms error is at most ``sqrt((ua**2 + ub**2)/3)``; that is
also the ratio of the largest error to the largest output, up to the spread of
the maxima, for which we allow a factor 2. An operand quantized twice (the
"row" weight gradient's requantized operand) adds its ``u`` once more, and the
output's rounding (bf16) adds ``2**-8``:

  forward  E4M3 x E4M3                 2*sqrt(2*u4**2/3)             + 2**-8 = 0.106
  dx       E5M2 x E4M3                 2*sqrt((u5**2 + u4**2)/3)     + 2**-8 = 0.165
  dw       E4M3 x E5M2 ("tensor")      the same                              = 0.165
  dw       "row", + one requantization 2*sqrt((u5**2+u4**2+ur**2)/3) + 2**-8
                                       = 0.181 (fc1, ur = u4) / 0.220 (fc2, ur = u5)

(measured: 0.04-0.06 forward, 0.07-0.08 dx, 0.06 / 0.085 dw.) The exact
checks compare against the float64 product of the operands quantized as a
whole (one global scale) to within the output dtype's rounding, which a scale
off by any factor, or a rank's own amax in place of the agreed one, fails.
"""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm.fp8 import (Fp8Recipe, dequantize, fp8_all_gather_matmul,
                               fp8_matmul_reduce_scatter, quantize_rows, quantize_tensor)

N, K, M = 64, 48, 32  # global tokens, input features, output features
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = {"tensor": Fp8Recipe(), "row": Fp8Recipe(scaling="row")}


def unit_roundoff(dtype) -> float:
  return 2.0 ** -(jnp.finfo(dtype).nmant + 1)


def gemm_tolerance(*operand_dtypes, out_dtype=jnp.bfloat16) -> float:
  """2 * sqrt(sum(u**2) / 3) over the operands' roundings, + the output's."""
  out = 2.0 ** -(jnp.finfo(out_dtype).nmant + 1)
  return 2 * math.sqrt(sum(unit_roundoff(d) ** 2 for d in operand_dtypes) / 3) + out


TOL_FORWARD = gemm_tolerance(E4, E4)
TOL_DX = gemm_tolerance(E5, E4)
TOL_DW = {("tensor", "ag"): gemm_tolerance(E4, E5), ("tensor", "rs"): gemm_tolerance(E4, E5),
          ("row", "ag"): gemm_tolerance(E4, E5, E4), ("row", "rs"): gemm_tolerance(E4, E5, E5)}


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _normal(seed, shapes, dtypes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(d) for k, s, d in zip(keys, shapes, dtypes)]


def _err(got, ref) -> float:
  got = np.asarray(got, np.float64)
  return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def run_op(op, mesh, x, w, ct, *, recipe, transpose_w=False, check_vma=True, **flags):
  """(y, dx, dw) of the op in shard_map under jit(value_and_grad(sum(y * ct)))."""
  if op == "ag":
    f = lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=recipe,
                                           transpose_w=transpose_w, **flags)
    specs = (P("tp"), P("tp", None) if transpose_w else P(None, "tp"))
    out_spec = P(*([None] * (x.ndim - 1)), "tp")
  else:
    f = lambda x, w: fp8_matmul_reduce_scatter(x, w, "tp", recipe=recipe,
                                               transpose_w=transpose_w, **flags)
    specs = (P(*([None] * (x.ndim - 1)), "tp"), P(None, "tp") if transpose_w else P("tp"))
    out_spec = P("tp")
  g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=check_vma)

  def loss(x, w):
    y = g(x, w)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
  return y, dx, dw


def reference(x, w, ct, transpose_w=False):
  x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
  wk = w.T if transpose_w else w
  y = np.einsum("...k,km->...m", x, wk)
  dx = np.einsum("...m,km->...k", ct, wk)
  dwk = x.reshape(-1, x.shape[-1]).T @ ct.reshape(-1, ct.shape[-1])
  return y, dx, (dwk.T if transpose_w else dwk)


def check(op, size, scaling, *, x_dtype=jnp.bfloat16, transpose_w=False, lead=(), **flags):
  seed = _seed(op, size, scaling, x_dtype, transpose_w, lead, flags)
  w_shape = (M, K) if transpose_w else (K, M)
  x, w, ct = _normal(seed, [(N,) + lead + (K,), w_shape, (N,) + lead + (M,)],
                     [x_dtype, jnp.float32, jnp.float32])
  got = run_op(op, cpu_mesh(size), x, w, ct, recipe=RECIPES[scaling],
               transpose_w=transpose_w, **flags)
  ref = reference(x, w, ct, transpose_w)
  for name, g, r, tol in zip(("y", "dx", "dw"), got, ref,
                             (TOL_FORWARD, TOL_DX, TOL_DW[scaling, op])):
    assert g.shape == r.shape, (name, g.shape, r.shape)
    assert _err(g, r) <= tol, f"{name}: error {_err(g, r):.4f} > tolerance {tol:.4f}"


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("size", [1, 2, 4], ids=lambda n: f"tp{n}")
def test_matches_float64(size, op, scaling):
  """Forward, dx and dw of each op and recipe within the FP8 tolerances."""
  check(op, size, scaling)


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("op, flags", [
    ("ag", dict(transpose_w=True)), ("ag", dict(keep_gathered_input=True)),
    ("ag", dict(x_dtype=jnp.float32)), ("ag", dict(lead=(2,))),
    ("rs", dict(transpose_w=True)), ("rs", dict(reuse_gathered=False)),
    ("rs", dict(x_dtype=jnp.float32)), ("rs", dict(lead=(2,))),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}" for k in v))
def test_flags_match_float64(op, flags, scaling):
  """transpose_w, keep_gathered_input, reuse_gathered=False, f32 activations
  and a leading dim folded into the tokens (2 devices)."""
  check(op, 2, scaling, **flags)


@pytest.mark.parametrize("scaling", RECIPES)
def test_return_gathered(scaling):
  """The returned gathered x is x as the GEMM saw it (within E4M3's rounding),
  and its cotangent is reduce-scattered into dx."""
  mesh = cpu_mesh(4)
  x, w, ct, ct_g = _normal(3, [(N, K), (K, M), (N, M), (4, N, K)], [jnp.float32] * 4)
  f = lambda x, w: (lambda y, g: (y, g[None]))(*fp8_all_gather_matmul(
      x, w, "tp", recipe=RECIPES[scaling], return_gathered=True))
  g = jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                    out_specs=(P(None, "tp"), P("tp")))

  def loss(x, w):
    y, gathered = g(x, w)
    return jnp.sum(y * ct) + jnp.sum(gathered * ct_g), gathered

  (_, gathered), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
  y_ref, dx_ref, dw_ref = reference(x, w, ct)
  assert _err(gathered[1], np.asarray(x)) <= unit_roundoff(E4)
  assert _err(dx, dx_ref + np.asarray(ct_g).sum(0)) <= TOL_DX
  assert _err(dw, dw_ref) <= TOL_DW[scaling, "ag"]


def _skewed(seed, shape, axis, size, shard=1, factor=100.0):
  """Normal f32 values with shard `shard` (of `size` along `axis`) x factor."""
  (a,) = _normal(seed, [shape], [jnp.float32])
  a = np.asarray(a).copy()
  idx = [slice(None)] * len(shape)
  step = shape[axis] // size
  idx[axis] = slice(shard * step, (shard + 1) * step)
  a[tuple(idx)] *= factor
  return jnp.asarray(a)


@pytest.mark.parametrize("scaling", RECIPES)
def test_gathered_bytes_use_one_agreed_scale(scaling):
  """One shard x100: the gathered FP8 operand is the whole tensor quantized at
  once (one global scale; per row for "row"), bit for bit."""
  mesh = cpu_mesh(4)
  x = _skewed(5, (N, K), 0, 4)
  (w,) = _normal(6, [(K, M)], [jnp.float32])
  f = lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=RECIPES[scaling],
                                         return_gathered=True)[1][None]
  gathered = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                   out_specs=P("tp")))(x, w)
  # Exact: the same amax (a maximum), scale (one division), bytes (one multiply
  # and one rounding each) and dequantization (one multiply) in both programs.
  q, inv = (quantize_tensor if scaling == "tensor" else quantize_rows)(x, E4)
  want = np.asarray(dequantize(q, inv))
  for rank in range(4):
    np.testing.assert_array_equal(np.asarray(gathered[rank]), want)
  # And the bytes themselves, through the quantize helper with axis_name.
  if scaling == "tensor":
    bytes_of = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
    local = lambda x: bytes_of(jax.lax.all_gather(
        quantize_tensor(x, E4, axis_name="tp")[0], "tp", axis=0, tiled=True))[None]
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(bytes_of(q)))


def _rowwise_err(got, ref) -> float:
  """max over rows of (the row's max error / the row's max |ref|)."""
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.max(np.abs(got - ref), 1) / np.max(np.abs(ref), 1)))


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_tensor_scaling_is_the_whole_tensor_quantized(op):
  """"tensor", one shard of x and of dy x100 (4 devices): y, dx and dw equal
  the float64 products of x, w and dy each quantized AS A WHOLE, to f32
  rounding, row by row: a rank quantizing with its own amax, or a scale off by
  a factor, is far outside."""
  size = 4
  x = _skewed(7, (N, K), 0 if op == "ag" else 1, size)
  ct = _skewed(8, (N, M), 1 if op == "ag" else 0, size, shard=2)
  (w,) = _normal(9, [(K, M)], [jnp.float32])
  y, dx, dw = run_op(op, cpu_mesh(size), x, w, ct, recipe=RECIPES["tensor"])
  q = lambda a, dt: np.asarray(dequantize(*quantize_tensor(a, dt)), np.float64)
  xq, wq, dyq = q(x, E4), q(w, E4), q(ct, E5)
  for name, got, want in (("y", y, xq @ wq), ("dx", dx, dyq @ wq.T),
                          ("dw", dw.T, (xq.T @ dyq).T)):
    assert _rowwise_err(got, want) <= 1e-5, (name, _rowwise_err(got, want))
