"""The one-pass FP8 casts (jax_comm_gemm.fp8.cast), on CPU: the Pallas kernel
(run by Pallas's interpreter here) writes the same bytes as XLA's passes, for
every input and FP8 type, with saturation, inf and NaN; the amax carries NaN;
and the FP8 ops give the same outputs and gradients with the kernel as with
XLA's casts, against float64 as well (the GPU runs the compiled kernel:
tests/gpu/one_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm.fp8 import Fp8Recipe, cast
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal, reference, run_op

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = cast.TILE  # the tests' shapes are multiples of it


def _bytes(a):
  """a's bytes, every NaN as one byte (E5M2 has three NaN encodings, and which
  one a NaN gets is XLA's choice)."""
  return np.where(np.isnan(np.asarray(a, np.float32)), 0xFF,
                  np.asarray(lax.bitcast_convert_type(a, jnp.uint8)))


def assert_codes_match_but_tanh_tail(got, want, tail):
  """got's FP8 bytes are want's, except where `tail` marks inputs at which
  float32's ``1 + tanh`` cancels (GELU and its derivative far below zero): there
  XLA:CPU's tanh differs in its last bits between a compiled fusion and the
  kernel under Pallas's interpreter (jax 0.12.0.1, the CPU test flags), and
  the codes may be one FP8 step apart in value order, or both within 1e-3 of
  the amax (a sign at zero)."""
  gb, wb = _bytes(got), _bytes(want)
  np.testing.assert_array_equal(gb[~tail], wb[~tail])
  def signed(b):  # FP8 codes in value order (sign-magnitude to signed)
    b = b.astype(np.int16)
    return np.where(b & 0x80, -(b & 0x7F), b)
  gv, wv = (np.asarray(a, np.float64) for a in (got, want))
  near_zero = 1e-3 * np.max(np.abs(wv))
  ok = (np.abs(signed(gb) - signed(wb)) <= 1) | (
      (np.abs(gv) <= near_zero) & (np.abs(wv) <= near_zero))
  assert ok[tail].all(), (f"{np.sum(~ok & tail)} codes where 1 + tanh cancels more than one "
                          f"step apart, e.g. {gv[~ok & tail][:3]} against {wv[~ok & tail][:3]}")


def _spoiled(dtype, shape=(2 * TILE, 3 * TILE), seed=0):
  """Normal values spread over E4M3's range and past it, with +-inf and NaN."""
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 200.0
  return (x.at[3, 5].set(jnp.inf).at[70, 9].set(-jnp.inf).at[100, 150].set(1e6)
          .at[200, 300].set(jnp.nan).astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("f8", [E4, E5])
@pytest.mark.parametrize("outputs", [dict(), dict(rows=False), dict(columns=False),
                                     dict(with_amax=True), dict(rows=False, with_amax=True),
                                     dict(columns=False, with_amax=True)])
def test_kernel_writes_xlas_bytes(dtype, f8, outputs):
  x = _spoiled(dtype)
  scale = jnp.float32(1.7)
  got = cast.cast_transpose(x, scale, f8, implementation="pallas", **outputs)
  want = cast.cast_transpose(x, scale, f8, implementation="xla", **outputs)
  for g, w in zip(got, want):
    assert (g is None) == (w is None)
    if g is not None and g.dtype == f8:
      np.testing.assert_array_equal(_bytes(g), _bytes(w))
    elif g is not None:  # the amax: the NaN's
      assert np.isnan(float(g)) and np.isnan(float(w))


def test_the_copies_are_the_saturated_cast_and_its_transpose():
  x = jnp.tile(jnp.array([[1.0, -2.0], [0.5, 1000.0]], jnp.float32), (TILE, TILE // 2))
  q, qT, a = cast.cast_transpose(x, 2.0, E4, with_amax=True, implementation="pallas")
  want = np.clip(np.asarray(x) * 2.0, -448, 448)
  np.testing.assert_array_equal(np.asarray(q, np.float32), want)
  np.testing.assert_array_equal(np.asarray(qT, np.float32), want.T)
  assert float(a) == 1000.0


@pytest.mark.parametrize("where", [(0, 0), (127, 191), (64, 63)])
def test_kernel_amax_carries_nan_from_any_tile(where):
  x = jnp.ones((2 * TILE, 3 * TILE), jnp.bfloat16).at[where].set(jnp.nan)
  _, _, a = cast.cast_transpose(x, 1.0, E4, rows=False, columns=False, with_amax=True,
                                implementation="pallas")
  assert np.isnan(float(a))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("wanted", [True, False])
def test_conditional_amax_kernel_matches_xla(dtype, wanted):
  """amax_if: the tensor's amax (inf, NaN: the spoiled input has both) where
  wanted, 0 where not, as XLA's."""
  for x in (_spoiled(dtype), _spoiled(dtype).at[200, 300].set(0),  # inf, no NaN
            jax.random.normal(jax.random.key(2), (TILE, 2 * TILE), dtype)):
    got = cast.amax_if(x, jnp.bool_(wanted), implementation="pallas")
    want = cast.amax_if(x, jnp.bool_(wanted), implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if wanted:
      assert float(got) == float(np.max(np.abs(np.asarray(x, np.float32)))) or np.isnan(got)
    else:
      assert float(got) == 0.0


@pytest.mark.parametrize("f8", [E4, E5])
def test_transpose_kernel_moves_the_bytes(f8):
  q = _spoiled(jnp.float32, (3 * TILE, TILE), seed=1).astype(f8)
  t = cast.transpose(q, implementation="pallas")
  assert t.dtype == q.dtype
  np.testing.assert_array_equal(_bytes(t), _bytes(q.T))


def test_auto_is_xla_off_a_gpu_and_for_untiled_shapes(monkeypatch):
  x = jnp.ones((2 * TILE, TILE), jnp.bfloat16)
  pallas = lambda f, *a: "pallas_call" in str(jax.make_jaxpr(f)(*a))
  assert not pallas(lambda x: cast.cast_transpose(x, 1.0, E4), x)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert pallas(lambda x: cast.cast_transpose(x, 1.0, E4), x)
  assert pallas(lambda q: cast.transpose(q), x.astype(E4))
  assert pallas(lambda x: cast.amax_if(x, True), x)
  # A row-major copy alone stays XLA's (it fuses into x's producer), as does a
  # shape the tiles do not divide.
  assert not pallas(lambda x: cast.cast_transpose(x, 1.0, E4, columns=False), x)
  assert not pallas(lambda x: cast.cast_transpose(x, 1.0, E4), x[:-1])


@pytest.mark.parametrize("call, match", [
    (lambda: cast.cast_transpose(jnp.ones((4, 4)), 1.0, E4, implementation="triton"),
     "implementation must be one of"),
    (lambda: cast.cast_transpose(jnp.ones((4,)), 1.0, E4), "`x` must be 2-D"),
    (lambda: cast.transpose(jnp.ones((4, 4), E4), implementation="cuda"),
     "implementation must be one of"),
    (lambda: Fp8Recipe(casts="pallas"), "Fp8Recipe.casts must be one of"),
    (lambda: cast.amax_if(jnp.ones((4, 4)), True, implementation="cuda"),
     "amax_if: implementation must be one of"),
    (lambda: cast.amax_if(jnp.ones((4, 4, 4)), True), "amax_if: `x` must be 2-D"),
])
def test_bad_arguments_are_named(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_recipe_key_names_the_casts_only_when_not_fused():
  assert "casts" not in Fp8Recipe().key
  assert Fp8Recipe.from_key(Fp8Recipe(casts="xla").key) == Fp8Recipe(casts="xla")
  with pytest.raises(ValueError, match="not an Fp8Recipe key"):
    Fp8Recipe.from_key(Fp8Recipe().key + " casts=xla extra")


def _assert_same_outputs(got, want):
  """(y, dx, dw) of an op on the kernel's casts against XLA's: the same FP8
  bytes, but the GEMMs read them in other layouts, so the CPU's f32 sums may
  round differently in the last bit. dw (float32 w) is written in x's bf16
  with its scale applied in bf16 too, which XLA's CPU fusions keep in float32
  in one program and not the other (excess precision): one bf16 rounding."""
  for g, w, rel in zip(got, want, (1e-5, 1e-5, 2.0 ** -8)):
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0,
                               atol=rel * np.max(np.abs(w)))


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
def test_ops_match_with_the_kernel(monkeypatch, op, scaling):
  """The FP8 ops with the kernel's casts (interpreted) equal those with XLA's,
  outputs and both gradients, and stay within the FP8 tolerances of float64."""
  from jax_comm_gemm.fp8 import AmaxHistory
  size = 2
  mesh = cpu_mesh(size)
  n, k, m = 2 * TILE * size, TILE * size, 2 * TILE
  x, w, ct = _normal(7, [(n, k), (k, m), (n, m)], [jnp.bfloat16, jnp.float32, jnp.float32])
  recipe = Fp8Recipe(scaling)
  flags = {"history": AmaxHistory.zeros(recipe)} if scaling == "delayed" else {}
  # Pallas's interpreter cannot run inside shard_map(check_vma=True) (its
  # block slices mix varying and invariant values); the GPU's lowering can.
  plain = run_op(op, mesh, x, w, ct, recipe=Fp8Recipe(scaling, casts="xla"),
                 check_vma=False, **flags)
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  fused = run_op(op, mesh, x, w, ct, recipe=recipe, check_vma=False, **flags)
  _assert_same_outputs(fused[:3], plain[:3])
  ref = reference(x, w, ct)
  assert _err(fused[0], ref[0]) < TOL_FORWARD
  assert _err(fused[1], ref[1]) < TOL_DX
  assert _err(fused[2], ref[2]) < TOL_DW[("tensor", op)]


def _delayed_step(op, mesh, recipe):
  """(y, dx, dw, next history) of a delayed op under jit(grad(sum(y * ct))).
  Without check_vma a replicated input's gradient is summed over the ranks:
  each rank gets its own copy of the history instead, and hands out its own
  next history (the test compares them)."""
  from jax_comm_gemm.fp8 import AmaxHistory, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
  ops = {"ag": (fp8_all_gather_matmul, (P("tp"), P(None, "tp")), P(None, "tp")),
         "rs": (fp8_matmul_reduce_scatter, (P(None, "tp"), P("tp")), P("tp"))}
  fn, specs, out = ops[op]
  f = lambda x, w, h: fn(x, w, "tp", recipe=recipe, history=AmaxHistory(*(a[0] for a in h)))
  g = jax.shard_map(f, mesh=mesh, in_specs=specs + (P("tp"),), out_specs=out,
                    check_vma=False)

  def loss(x, w, h, ct):
    y = g(x, w, h)
    return jnp.sum(y.astype(jnp.float32) * ct), y
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  size = mesh.shape["tp"]

  def run(x, w, h, ct):
    (_, y), (dx, dw, nxt) = step(x, w, AmaxHistory(*(jnp.stack([a] * size) for a in h)), ct)
    for a in nxt:  # every rank's next history is the same
      np.testing.assert_array_equal(np.asarray(a), np.asarray(a[:1]).repeat(size, 0))
    return y, dx, dw, AmaxHistory(*(a[0] for a in nxt))
  return run


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("steady", [False, True], ids=["empty", "steady"])
def test_delayed_scaling_on_the_kernels_passes(monkeypatch, op, steady):
  """Delayed scaling on the kernels (this step's amax read only while the
  history is empty; the next history's amax from the cast's pass) gives XLA's
  passes' outputs, gradients and next history, at the first step and after."""
  from jax_comm_gemm.fp8 import AmaxHistory
  mesh = cpu_mesh(2)
  n, k, m = 4 * TILE, 2 * TILE, 2 * TILE
  x, w, ct = _normal(8, [(n, k), (k, m), (n, m)], [jnp.bfloat16, jnp.float32, jnp.float32])
  recipe = Fp8Recipe("delayed", amax_history=4)
  h = AmaxHistory.zeros(recipe)
  if steady:  # an amax history unlike this step's: its largest entry scales
    h = AmaxHistory(jnp.array([0.0, 3.0, 9.0, 0.0]), jnp.array([0.5, 0.0, 0.0, 0.0]),
                    jnp.array([1e-3, 0.0, 0.0, 2e-3]))
  plain = _delayed_step(op, mesh, Fp8Recipe("delayed", amax_history=4, casts="xla"))(x, w, h, ct)
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  fused = _delayed_step(op, mesh, recipe)(x, w, h, ct)
  _assert_same_outputs(fused[:3], plain[:3])
  # The amaxes are maxima: exact. The newest entry is this step's true amax.
  for name, got, want in zip(AmaxHistory._fields, fused[3], plain[3]):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
  assert float(fused[3].x[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  assert float(fused[3].w[0]) == float(jnp.max(jnp.abs(w)))
  np.testing.assert_array_equal(np.asarray(fused[3].x[1:]), np.asarray(h.x[:-1]))


def test_every_kernel_lowers_to_triton():
  """Each kernel's Pallas program lowers to a Triton call for a CUDA device,
  here on CPU: a primitive with no Triton lowering rule (a NaN test, a bit
  cast, a vector's or a column's block) fails here, not first on a GPU."""
  from jax_comm_gemm.fp8 import heads, prologue
  e4 = jnp.dtype(jnp.float8_e4m3fn)
  x = jax.ShapeDtypeStruct((2 * TILE, 4 * TILE), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((4 * TILE,), jnp.bfloat16)
  one = jax.ShapeDtypeStruct((1,), jnp.float32)
  column = jax.ShapeDtypeStruct((2 * TILE, 1), jnp.float32)  # a row statistic
  gelu = prologue.with_bias(jax.nn.gelu)
  swiglu = prologue.gated(jax.nn.silu)
  wide = jax.ShapeDtypeStruct((2 * TILE, 8 * TILE), jnp.bfloat16)  # gate and up of x's shape
  part = jax.ShapeDtypeStruct((2, TILE, 2, TILE), jnp.bfloat16)  # attention's [b, s, h, d]
  kernels = {
      "cast": (lambda x, s: cast._pallas((x,), s, e4, True, True, True, False,
                                         cast.CAST_TILING, None), (x, one)),
      "transpose": (lambda q: cast._move(q, 1), (jax.ShapeDtypeStruct(x.shape, jnp.uint8),)),
      "transpose_tokens": (lambda q: cast._move(q, 2),
                           (jax.ShapeDtypeStruct(x.shape, jnp.uint8),)),
      "heads": (lambda q, k, v, s: heads._heads((q, k, v), s, e4, True, False),
                (part, part, part, one)),
      "heads_sums": (lambda q, k, v, s: heads._heads((q, k, v), s, e4, True, True),
                     (part, part, part, one)),
      "bias_gelu": (lambda x, b, s: cast._pallas((x, b), s, e4, True, True, True, False,
                                                 cast.PROLOGUE_TILING, gelu), (x, b, one)),
      "dbias_gelu_sums": (lambda d, x, b, s: cast._pallas(
          (d, x, b), s, e4, True, True, True, True, cast.PROLOGUE_TILING,
          prologue.activation_gradient(gelu)), (x, x, b, one)),
      "layer_norm": (lambda x, m, r, b, s: cast._pallas(
          (x, m, r, b, b), s, e4, True, False, True, False, cast.PROLOGUE_TILING,
          prologue.layer_norm), (x, column, column, b, one)),
      "amax_if": (lambda x, b, f: cast._amax_if((x, b), f, gelu),
                  (x, b, jax.ShapeDtypeStruct((1,), jnp.int32))),
      # The gated product reads two halves of one operand; its gradient writes two.
      "swiglu": (lambda h, s: cast._pallas((h,), s, e4, True, True, True, False,
                                           cast.PROLOGUE_TILING, swiglu), (wide, one)),
      "dswiglu_sums": (lambda d, h, s: cast._pallas(
          (d, h), s, e4, True, True, True, True, cast.PROLOGUE_TILING,
          prologue.activation_gradient(swiglu)), (x, wide, one)),
      "amax_if_dswiglu": (lambda d, h, f: cast._amax_if(
          (d, h), f, prologue.activation_gradient(swiglu)),
          (x, wide, jax.ShapeDtypeStruct((1,), jnp.int32))),
  }
  triton = "__gpu$xla.gpu.triton"
  for name, (f, args) in kernels.items():
    try:
      exported = jax.export.export(
          jax.jit(f), platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
    except RuntimeError as e:  # newer jax reads the GPU's compute capability here
      if "No supported GPU devices" in str(e):
        pytest.skip(f"jax {jax.__version__} lowers Pallas for Triton only with a GPU")
      raise
    assert triton in exported.mlir_module(), name
