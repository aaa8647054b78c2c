"""The MLP's two FP8 ops as one custom_vjp (``fp8_mlp``), on CPU: its output
and every gradient (x, both kernels, fc1's bias) match float64 for every
recipe, with the cast kernel (Pallas's interpreter here) and with XLA's
casts; the kernel makes fc1's output gradient from (dh, pre) in one pass,
with the bias's column sums, writing the bytes XLA's passes write; delayed
scaling records that gradient's amax; the transformer block's backward runs
GELU's derivative only inside the kernel; bad arguments are named. The GPU
runs the compiled kernel (tests/gpu/one_gpu.py)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.fp8 import AmaxHistory, Fp8Recipe, cast, fp8_mlp, prologue
from jax_comm_gemm.layers import transformer as tb
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal
from test_fp8_activation import _gelu64, block_tanh_sites
from test_fp8_cast import _bytes, assert_codes_match_but_tanh_tail
from tolerance import assert_fp8_programs_close

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = cast.TILE
DGELU = prologue.activation_gradient(jax.nn.gelu)


def _inputs(seed, n, k, f):
  x, w1, b1, w2, ct = _normal(seed, [(n, k), (k, f), (f,), (f, k), (n, k)],
                              [jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float32,
                               jnp.float32])
  # Pre-activations of order 1, over GELU's curve on both sides.
  return x, w1 / np.sqrt(k) * 2, b1 * 0.5, w2 / np.sqrt(f), ct


def _run(mesh, recipe, histories, x, w1, b1, w2, ct, mlp=None):
  """(y, dx, dw1, db1, dw2, next histories) under jit(value_and_grad(sum(y * ct)))
  of `mlp` (x, w1, b1, w2, histories), fp8_mlp by default."""
  size = mesh.shape["tp"]
  mlp = mlp or (lambda x, w1, b1, w2, hs: fp8_mlp(x, w1, b1, w2, "tp", activation=jax.nn.gelu,
                                                  recipe=recipe, histories=hs))

  def f(x, w1, b1, w2, hs):
    return mlp(x, w1, b1, w2, tuple(None if h is None else AmaxHistory(*(a[0] for a in h))
                                    for h in hs))
  g = jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp"),
                                            P("tp")),
                    out_specs=P("tp"), check_vma=False)
  # Each rank its own copy of a history (check_vma=False sums a replicated one).
  hs = tuple(None if h is None else AmaxHistory(*(jnp.stack([a] * size) for a in h))
             for h in histories)
  loss = lambda x, w1, b1, w2, hs: jnp.sum(g(x, w1, b1, w2, hs).astype(jnp.float32) * ct)
  y = jax.jit(g)(x, w1, b1, w2, hs)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w1, b1, w2, hs)
  nxt = tuple(None if h is None else AmaxHistory(*(a[0] for a in h)) for h in grads[4])
  return (y, *grads[:4], nxt)


def _reference(x, w1, b1, w2, ct):
  x, w1, b1, w2, ct = (np.asarray(a, np.float64) for a in (x, w1, b1, w2, ct))
  pre = x @ w1 + b1
  a, da = _gelu64(pre)
  dpre = (ct @ w2.T) * da
  return (a @ w2, dpre @ w1.T, x.T @ dpre, dpre.sum(0), a.T @ ct), dpre


@pytest.mark.parametrize("scaling, kernel", [
    ("tensor", False), ("tensor", True), ("delayed", False), ("delayed", True),
    ("row", False), ("block", False)])
def test_fp8_mlp_matches_float64(monkeypatch, scaling, kernel):
  size = 2
  mesh = cpu_mesh(size)
  n, k, f = 2 * TILE * size, TILE * size, 2 * TILE * size
  x, w1, b1, w2, ct = _inputs(21, n, k, f)
  if kernel:
    monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  recipe = Fp8Recipe(scaling)
  histories = ((AmaxHistory.zeros(recipe),) * 2 if scaling == "delayed" else (None, None))
  got = _run(mesh, recipe, histories, x, w1, b1, w2, ct)
  tol_dw = TOL_DW[("row" if scaling == "row" else "tensor", "ag")]
  tol_dw = tol_dw if scaling != "block" else 2 * tol_dw
  # Two FP8 GEMMs in a row: an output's tolerance is its last GEMM's, doubled (b1's:
  # a sum over tokens, whose errors average).
  tols = (2 * TOL_FORWARD, 2 * TOL_DX, 2 * tol_dw, TOL_DX, tol_dw)
  refs, dpre = _reference(x, w1, b1, w2, ct)
  for name, g, r, tol in zip(("y", "dx", "dw1", "db1", "dw2"), got, refs, tols):
    assert _err(g, r) <= tol, f"{name}: error {_err(g, r):.4f} > tolerance {tol:.4f}"
  if scaling == "delayed":  # fc1's output gradient's amax, from the pass that made it
    amax = np.max(np.abs(dpre))
    assert abs(float(got[5][0].dy[0]) - amax) <= TOL_DX * amax
    assert float(got[5][0].dy[1]) == 0.0  # the history shifted, nothing else recorded


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_mlp_equals_its_two_ops(bias):
  """With XLA's casts, the one custom_vjp computes what the two ops compute:
  without fc1's bias the same FP8 arithmetic in two programs, whose GELU may
  round otherwise, so a code may flip (tests/tolerance.py: E4M3 forward, E5M2
  in the gradients and their amaxes); with it within FP8's tolerance (other
  arithmetic: one op adds it in float32 inside fc2's cast, the two ops in bf16
  before it) and the histories' amaxes within 1% (bf16's rounding of the sum,
  2**-8, with room)."""
  from jax_comm_gemm.fp8 import fp8_all_gather_matmul, fp8_matmul_reduce_scatter
  mesh = cpu_mesh(2)
  x, w1, b1, w2, ct = _inputs(22, 4 * TILE, 2 * TILE, 4 * TILE)
  recipe = Fp8Recipe("delayed")
  hs = (AmaxHistory.zeros(recipe),) * 2

  def one(x, w1, b1, w2, hs):
    return fp8_mlp(x, w1, b1 if bias else None, w2, "tp", activation=jax.nn.gelu,
                   recipe=recipe, histories=hs)

  def two(x, w1, b1, w2, hs):
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=hs[0])
    return fp8_matmul_reduce_scatter(h + b1 if bias else h, w2, "tp", recipe=recipe,
                                     history=hs[1], activation=jax.nn.gelu)
  got, want = (_run(mesh, recipe, hs, x, w1, b1, w2, ct, mlp=f) for f in (one, two))
  names = ("y", "dx", "dw1", "db1", "dw2")
  if not bias:
    n, k = x.shape
    f = w1.shape[1]
    for name, a, b, fmt, red in zip(names, got[:5], want[:5], (E4, E5, E5, E5, E5),
                                    (k + f, f + k, n, n, n)):
      assert_fp8_programs_close(a, b, fmt=fmt, k=red, what=name)
    for h_got, h_want in zip(got[5], want[5]):
      for field, a, b in zip(AmaxHistory._fields, h_got, h_want):
        assert_fp8_programs_close(a, b, fmt=E5, k=k + f, what=f"amax {field}")
    return
  tols = (TOL_FORWARD, TOL_DX, TOL_DW[("tensor", "ag")], TOL_DX, TOL_DW[("tensor", "ag")])
  for name, a, b, tol in zip(names, got[:5], want[:5], tols):
    assert 0 < _err(a, b) <= tol, f"{name}: {_err(a, b):.4f} (tolerance {tol})"
  for h_got, h_want in zip(got[5], want[5]):
    for a, b in zip(h_got, h_want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2)


@pytest.mark.parametrize("f8", [E4, E5])
@pytest.mark.parametrize("outputs", [dict(with_amax=True, with_column_sums=True),
                                     dict(rows=False, with_column_sums=True),
                                     dict(with_amax=True)])
def test_kernel_casts_the_gradient_through_the_activation(f8, outputs):
  """The kernel's (dh, pre) -> dgelu pass writes XLA's bytes for the same
  arithmetic, and the column sums of the bf16-rounded gradient."""
  dh, pre = _normal(23, [(2 * TILE, 3 * TILE)] * 2, [jnp.bfloat16] * 2)
  pre = pre * 3
  scale = jnp.float32(300.0)
  got = cast.cast_transpose((dh, pre), scale, f8, implementation="pallas", prologue=DGELU,
                            **outputs)
  want = jax.jit(lambda dh, pre: cast.cast_transpose(
      (dh, pre), scale, f8, implementation="xla", prologue=DGELU, **outputs))(dh, pre)
  rounded = jax.jit(lambda dh, pre: prologue.activated((dh, pre), DGELU))(dh, pre)
  tail = np.asarray(pre, np.float32) < -2  # where float32's 1 + tanh cancels
  for g, w, t in zip(got[:2], want[:2], (tail, tail.T)):
    assert (g is None) == (w is None)
    if g is not None:
      assert_codes_match_but_tanh_tail(g, w, t)
  if outputs.get("with_amax"):
    assert float(got[2]) == pytest.approx(float(jnp.max(jnp.abs(rounded.astype(jnp.float32)))),
                                          rel=1e-2)
  if outputs.get("with_column_sums"):
    sums = np.asarray(rounded, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(got[3]), sums, rtol=0,
                               atol=1e-2 * np.max(np.abs(sums)))
    # The derivative itself, against float64's.
    d64 = np.asarray(dh, np.float64) * _gelu64(np.asarray(pre, np.float64))[1]
    np.testing.assert_allclose(np.asarray(got[3]), d64.sum(0), rtol=0,
                               atol=2e-2 * np.max(np.abs(d64.sum(0))))


def test_conditional_amax_of_the_gradient_through_the_activation():
  dh, pre = _normal(24, [(TILE, 2 * TILE)] * 2, [jnp.bfloat16] * 2)
  want = float(jax.jit(lambda a, b: jnp.max(jnp.abs(
      prologue.activated((a, b), DGELU).astype(jnp.float32))))(dh, pre))
  for impl in ("pallas", "xla"):
    got = cast.amax_if((dh, pre), jnp.bool_(True), implementation=impl, prologue=DGELU)
    assert float(got) == pytest.approx(want, rel=1e-2), impl
  assert float(cast.amax_if((dh, pre), jnp.bool_(False), implementation="pallas",
                            prologue=DGELU)) == 0.0


@pytest.mark.parametrize("backward", [False, True], ids=["bias_gelu", "d_bias_gelu"])
def test_kernel_takes_the_bias_as_a_vector_operand(backward):
  """fc1's bias inside fc2's cast: a vector operand, each tile reading its
  columns' slice. The kernel writes XLA's bytes for GELU(h + b) (and for its
  derivative from (dh, h, b)), the amax and the conditional amax too, and
  differs from the cast of GELU(h) (the bias counts)."""
  dh, h = _normal(25, [(2 * TILE, 3 * TILE)] * 2, [jnp.bfloat16] * 2)
  b = jnp.linspace(-2.0, 2.0, 3 * TILE).astype(jnp.bfloat16)
  f = prologue.with_bias(jax.nn.gelu)
  if backward:
    f, operands = prologue.activation_gradient(f), (dh, h, b)
  else:
    operands = (h, b)
  scale = jnp.float32(100.0)
  got = cast.cast_transpose(operands, scale, E4, with_amax=True, with_column_sums=True,
                            implementation="pallas", prologue=f)
  want = jax.jit(lambda *a: cast.cast_transpose(
      a, scale, E4, with_amax=True, with_column_sums=True, implementation="xla",
      prologue=f))(*operands)
  tail = np.asarray(h, np.float32) + np.asarray(b, np.float32) < -2  # 1 + tanh cancels
  for g, w, t in zip(got[:2], want[:2], (tail, tail.T)):
    assert_codes_match_but_tanh_tail(g, w, t)
  assert float(got[2]) == pytest.approx(float(want[2]), rel=1e-2)
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=0,
                             atol=1e-2 * float(np.max(np.abs(want[3]))))
  unbiased = cast.cast_transpose(operands[:-1], scale, E4, implementation="xla",
                                 prologue=DGELU if backward else jax.nn.gelu)
  assert np.mean(_bytes(unbiased[0]) != _bytes(got[0])) > 0.5
  assert float(cast.amax_if(operands, jnp.bool_(True), implementation="pallas",
                            prologue=f)) == pytest.approx(float(want[2]), rel=1e-2)


def test_block_backward_runs_the_activations_derivative_inside_the_cast(monkeypatch):
  """Under delayed FP8 the block's value-and-grad computes GELU (tanh) only
  inside kernels: the forward's cast and the backward's gradient cast; fc1's
  output gradient is never written in bf16. bf16 computes it in XLA."""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  fp8 = block_tanh_sites(CommGemmConfig(fp8=Fp8Recipe("delayed")), grad=True)
  # forward cast, first step's amax, backward cast, its first step's amax
  assert set(fp8) == {True} and len(fp8) >= 4
  assert set(block_tanh_sites(CommGemmConfig(), grad=True)) == {False}


def test_block_gradients_match_the_two_ops(monkeypatch):
  """The block under delayed FP8 (one op for the MLP) against the same block
  built from the two ops, on the kernels: other arithmetic (the one op adds
  fc1's bias in float32 inside fc2's cast, the two ops in bf16 before it), so
  the loss within the forward's FP8 tolerance and the gradients within the
  weight gradient's (tests/test_fp8.py; the metric: the largest error over
  the largest value)."""
  from jax_comm_gemm.layers import dense
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  layout = tb.param_layout(TILE, 2 * TILE, "tp")
  leaves, tree = jax.tree.flatten(layout)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  params = jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32) * 0.05
                                     for k, s in zip(keys, leaves)])
  x = jax.random.normal(jax.random.key(6), (2 * TILE, 1, TILE), jnp.bfloat16)
  options = tb.BlockOptions(num_heads=2, dtype=jnp.bfloat16,
                            config=CommGemmConfig(fp8=Fp8Recipe("delayed")))

  def grads():
    h = tb.init_fp8_histories(options)
    f = jax.shard_map(lambda x, p, h: tb.transformer_block(x, p, axis_name="tp",
                                                            options=options, fp8_histories=h),
                      mesh=mesh, in_specs=(P("tp"), tb.partition_specs(params, "tp"), P()),
                      out_specs=P("tp"), check_vma=False)
    loss = lambda p, x, h: jnp.sum(f(x, p, h).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params, x, h)
  fused = grads()

  def two_ops(x, k1, b1, k2, b2, *, axis_name, activation, keep_gathered_input, precision,
              config, fp8_histories, prologue, plan=None):
    h = dense.column_parallel(x, k1, b1, axis_name=axis_name, precision=precision,
                              config=config, fp8_history=fp8_histories[0],
                              prologue=prologue, plan=plan)
    return dense.row_parallel(h, k2, b2, axis_name=axis_name, precision=precision,
                              config=config, fp8_history=fp8_histories[1],
                              activation=activation, plan=plan)
  monkeypatch.setattr(dense, "mlp_parallel", two_ops)
  two = grads()
  assert float(fused[0]) == pytest.approx(float(two[0]), rel=TOL_FORWARD)
  for path, a in jax.tree_util.tree_leaves_with_path(fused[1]):
    b = two[1]
    for p in path:
      b = b[p.key]
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    name, tol = jax.tree_util.keystr(path), TOL_DW[("tensor", "ag")]
    assert _err(a, np.asarray(b, np.float64)) <= tol, f"{name}: {_err(a, b):.4f} > {tol:.4f}"


@pytest.mark.parametrize("change, match", [
    (dict(w2=jnp.ones((2 * TILE, 3))), "`w2` must be"),
    (dict(b1=jnp.ones((3,))), "`b1` must be None or"),
    (dict(activation=None), "`activation`"),
    (dict(collectives=("xla",)), "one entry per layer"),
])
def test_bad_arguments_are_named(change, match):
  mesh = cpu_mesh(1)
  args = dict(x=jnp.ones((TILE, TILE), jnp.bfloat16), w1=jnp.ones((TILE, 2 * TILE)),
              b1=None, w2=jnp.ones((2 * TILE, TILE)), activation=jax.nn.gelu)
  args.update(change)
  extra = {k: args.pop(k) for k in ("collectives",) if k in args}

  def f(x):
    return fp8_mlp(x, args["w1"], args["b1"], args["w2"], "tp",
                   activation=args["activation"], **extra)
  with pytest.raises((ValueError, TypeError), match=match):
    jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)(
        args["x"])
