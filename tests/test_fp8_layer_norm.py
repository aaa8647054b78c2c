"""A LayerNorm's normalization inside the FP8 cast of the GEMM input it feeds
(``fp8.prologue.layer_norm`` as the column-parallel op's `prologue`), on CPU:
the cast kernel (Pallas's interpreter here) reads the row statistics as
``[r, 1]`` operands and writes the bytes and amax that XLA's passes write; the
op's output and the gradients of x, the LayerNorm's scale and bias and the
weight match float64 for each recipe, and equal, with XLA's casts, the op
applied to the LayerNorm's output; the transformer block's LayerNorms run
inside the casts. The GPU runs the compiled kernel (tests/gpu/one_gpu.py)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.fp8 import AmaxHistory, Fp8Recipe, cast, fp8_all_gather_matmul, prologue
from jax_comm_gemm.layers import transformer as tb
from test_flax_linen import x64
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal
from tolerance import assert_fp8_codes_close, assert_fp8_programs_close, eps

TILE = cast.TILE
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
EPS = 1e-6


def _inputs(seed, n, k, m):
  x, scale, bias, w, ct = _normal(seed, [(n, k), (k,), (k,), (k, m), (n, m)],
                                  [jnp.float32] * 5)
  # Rows of their own mean and spread, so that the statistics matter.
  rows = jnp.arange(n, dtype=jnp.float32)[:, None]
  x = (x * (1 + rows % 3) + rows % 5 - 2).astype(jnp.bfloat16)
  return x, 1 + 0.2 * scale, 0.3 * bias, w / np.sqrt(k), ct


def _operands(x, scale, bias, dtype=jnp.bfloat16):
  return tb.normalization(x, {"scale": scale, "bias": bias}, EPS, dtype)


def test_kernel_writes_xla_bytes():
  """Row statistics as [r, 1] operands: the kernel's rows, columns and amax
  are XLA's. Two programs of a LayerNorm each sum in its own order: a bf16
  output may round one step otherwise (the amax), and its FP8 code flip
  (tests/tolerance.py)."""
  x, scale, bias, _, _ = _inputs(1, 2 * TILE, 3 * TILE, TILE)
  ops = tuple(a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a for a in _operands(x, scale, bias))
  s = jnp.float32(3.0)
  args = dict(rows=True, columns=True, with_amax=True, prologue=prologue.layer_norm)
  got = cast.cast_transpose(ops, s, jnp.float8_e4m3fn, implementation="pallas", **args)
  want = cast.cast_transpose(ops, s, jnp.float8_e4m3fn, implementation="xla", **args)
  for name, a, b in zip(("rows", "columns"), got[:2], want[:2]):
    assert_fp8_codes_close(a, b, what=name)
  assert float(got[2]) == pytest.approx(float(want[2]), rel=eps(jnp.bfloat16))
  # And they are the LayerNorm's: the bf16 output scaled, cast.
  ln = tb.layer_norm(x, {"scale": scale, "bias": bias}, EPS, jnp.bfloat16)
  assert_fp8_codes_close(got[0], jnp.clip(ln.astype(jnp.float32) * s, -448, 448).astype(E4),
                         what="the LayerNorm's codes")


def _run(mesh, recipe, x, scale, bias, w, ct, fused=True, check_vma=True):
  """(y, dx, dscale, dbias, dw) of sum(op(LN(x)) @ w * ct)): the LayerNorm
  inside the op's cast (`fused`), or before it. (Pallas's interpreter needs
  check_vma=False.)"""
  h = AmaxHistory.zeros(recipe) if recipe.scaling == "delayed" else None

  def f(x, scale, bias, w):
    if fused:
      return fp8_all_gather_matmul(_operands(x, scale, bias), w, "tp", recipe=recipe,
                                   history=h, prologue=prologue.layer_norm)
    ln = tb.layer_norm(x, {"scale": scale, "bias": bias}, EPS, jnp.bfloat16)
    return fp8_all_gather_matmul(ln, w, "tp", recipe=recipe, history=h)
  g = jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(), P(), P(None, "tp")),
                    out_specs=P(None, "tp"), check_vma=check_vma)
  loss = lambda *a: jnp.sum(g(*a).astype(jnp.float32) * ct)
  y = jax.jit(g)(x, scale, bias, w)
  return (y, *jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, scale, bias, w))


def _reference(x, scale, bias, w, ct):
  with x64():
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, scale, bias, w, ct)]

    def f(x, scale, bias, w):
      return tb.layer_norm(x, {"scale": scale, "bias": bias}, EPS, jnp.float64) @ w
    y = f(*args[:4])
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * args[4]), argnums=(0, 1, 2, 3))(*args[:4])
    return [np.asarray(a) for a in (y, *grads)]


@pytest.mark.parametrize("scaling, kernel", [
    ("tensor", False), ("tensor", True), ("delayed", True), ("row", False)])
def test_column_op_with_layer_norm_matches_float64(monkeypatch, scaling, kernel):
  if kernel:
    monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  mesh = cpu_mesh(2)
  args = _inputs(2, 4 * TILE, 2 * TILE, 2 * TILE)
  got = _run(mesh, Fp8Recipe(scaling), *args, check_vma=not kernel)
  tol_dw = TOL_DW[("row" if scaling == "row" else "tensor", "ag")]
  # The LayerNorm's gradients are the input gradient's (one FP8 GEMM), through it.
  tols = (TOL_FORWARD, 2 * TOL_DX, TOL_DX, TOL_DX, tol_dw)
  for name, g, r, tol in zip(("y", "dx", "dscale", "dbias", "dw"), got,
                             _reference(*args), tols):
    assert _err(g, r) <= tol, f"{name}: error {_err(g, r):.4f} > tolerance {tol:.4f}"
  # Exactly, whatever the FP8 error in dy: a LayerNorm's output does not move
  # when its row shifts, so each row of dx sums to 0 (the mean's gradient; FP8's
  # tolerance above would miss it).
  dx = np.asarray(got[1], np.float64)
  assert np.max(np.abs(dx.sum(1)) / np.abs(dx).sum(1)) < 5e-3


def test_layer_norm_inside_the_op_equals_before_it():
  """With XLA's casts, the LayerNorm inside the op computes what the op
  computes on the LayerNorm's output, gradients included: two programs of the
  same FP8 arithmetic, whose LayerNorms sum in their own orders, so a code may
  flip (tests/tolerance.py), E4M3 forward, E5M2 in the gradients."""
  mesh = cpu_mesh(2)
  args = _inputs(3, 4 * TILE, 2 * TILE, 2 * TILE)
  recipe = Fp8Recipe("delayed")
  fused, before = (_run(mesh, recipe, *args, fused=f) for f in (True, False))
  n, k, m = args[0].shape + args[3].shape[1:]
  for name, a, b, fmt, red in zip(("y", "dx", "dscale", "dbias", "dw"), fused, before,
                                  (E4, E5, E5, E5, E5), (k, m + k, n, n, n)):
    assert_fp8_programs_close(a, b, fmt=fmt, k=red, what=name)


def _kernel_names(jaxpr):
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      info = e.params.get("name") or e.params.get("name_and_src_info")  # by jax version
      yield getattr(info, "name", str(info))
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _kernel_names(sub)


def test_block_normalizes_inside_the_casts(monkeypatch):
  """The transformer block under delayed FP8 casts both LayerNorms' outputs
  in the kernel that computes them, and its gradients match the block with
  the LayerNorms before the casts (the same numerics, in other passes)."""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(s.shape[-1]), s.shape) * 0.05,
                        tb.param_layout(TILE, 2 * TILE, "tp"))
  x = jax.random.normal(jax.random.key(7), (TILE, 1, TILE), jnp.bfloat16)
  options = tb.BlockOptions(num_heads=2, dtype=jnp.bfloat16,
                            config=CommGemmConfig(fp8=Fp8Recipe("delayed")))
  h = tb.init_fp8_histories(options)
  f = jax.shard_map(lambda x, p, h: tb.transformer_block(x, p, axis_name="tp",
                                                          options=options, fp8_histories=h),
                    mesh=mesh, in_specs=(P("tp"), tb.partition_specs(params, "tp"), P()),
                    out_specs=P("tp"), check_vma=False)
  names = list(_kernel_names(jax.make_jaxpr(f)(x, params, h).jaxpr))
  assert sum(n.endswith("_layer_norm") for n in names) == 2, names
  loss = lambda p, x, h: jnp.sum(f(x, p, h).astype(jnp.float32) ** 2)
  fused = jax.jit(jax.grad(loss))(params, x, h)
  # The same block with its LayerNorms applied before the ops.
  normalization, layer_norm = tb.normalization, prologue.layer_norm
  monkeypatch.setattr(tb, "normalization", lambda *a: (
      prologue.activated(normalization(*a), layer_norm).astype(a[-1]),))
  monkeypatch.setattr(prologue, "layer_norm", None)
  before = jax.jit(jax.grad(loss))(params, x, h)
  # Two programs of the same FP8 arithmetic: a code may flip (tests/tolerance.py);
  # the reductions: the block's GEMMs (over TILE and 2 TILE), attention's and
  # the weight gradients' (over the TILE tokens), forward and backward.
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fused), jax.tree.leaves(before)):
    assert_fp8_programs_close(a, b, fmt=E5, k=16 * TILE, what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("operands, use_prologue, match", [
    (lambda x: (x, x[:, :1], x[:1]), True, r"as a prologue's operands .* got shapes"),
    (lambda x: (x, x), False, "may be a tuple only as the operands of a `prologue`"),
    (lambda x: (x[0],), True, r"must be \[tokens, \.\.\., k\]"),
])
def test_bad_operands_are_named(operands, use_prologue, match):
  """The op names `x` and the shapes a prologue's operands may take, before
  any work (the one rule of the op and its kernels, prologue.operands)."""
  x = jnp.ones((TILE, TILE), jnp.bfloat16)
  w = jnp.ones((TILE, TILE), jnp.float32)
  with pytest.raises(ValueError, match=match):
    jax.shard_map(lambda x: fp8_all_gather_matmul(
        operands(x), w, "tp", prologue=prologue.layer_norm if use_prologue else None),
        mesh=cpu_mesh(1), in_specs=P("tp"), out_specs=P("tp"), check_vma=False)(x)
