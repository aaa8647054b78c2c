"""Attention's layout inside the FP8 casts (``jax_comm_gemm.fp8.heads``), on
CPU: ``cast_heads`` (Pallas's interpreter here) writes the bytes of XLA's
layout change then cast, and the transposed copy with the tokens ``(batch,
position)`` that ``cast.transpose(batch=)`` gives the other operand; the ops
with ``split_heads`` / ``merge_heads`` compute what they compute with XLA's
copies outside them, forward and gradients, at tp = 1, 2 and 4; bad
arguments are named; the transformer block takes its attention through them.
The GPU runs the compiled kernels (tests/gpu/one_gpu.py::check_heads_casts)."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.fp8 import (AmaxHistory, Fp8Recipe, cast, fp8_all_gather_matmul,
                               fp8_matmul_reduce_scatter, heads)
from jax_comm_gemm.layers import dense, transformer as tb
from test_fp8_cast import _bytes
from tolerance import assert_fp8_programs_close, assert_reduction_close

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _parts(seed, n, shape):
  keys = jax.random.split(jax.random.key(seed), n)
  parts = [(jax.random.normal(k, shape) * 100).astype(jnp.bfloat16) for k in keys]
  # inf, NaN and values that saturate, in the middle part
  parts[n // 2] = parts[n // 2].at[0, 3, 0, 5].set(jnp.inf).at[1, 70, 1, 9].set(jnp.nan)
  return parts


@pytest.mark.parametrize("n", [3, 1])
@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_cast_heads_kernel_writes_xlas_bytes(n, dtype):
  b, s, h, d = 2, 128, 2, 128
  parts = _parts(0, n, (b, s, h, d))
  got = heads.cast_heads(parts, 3.0, dtype, with_amax=True, implementation="pallas")
  want = heads.cast_heads(parts, 3.0, dtype, with_amax=True, implementation="xla")
  for g, w in zip(got[:2], want[:2]):
    np.testing.assert_array_equal(_bytes(g), _bytes(w))
  assert np.isnan(float(got[2])) and np.isnan(float(want[2]))
  # The layout itself, from numpy: rows (position, batch), columns (head, part, d).
  x = np.stack([np.asarray(p, np.float32) for p in parts], -2)   # [b, s, h, n, d]
  rows = np.swapaxes(x, 0, 1).reshape(s * b, h * n * d)
  finite = np.isfinite(rows)
  fp8 = jnp.finfo(dtype)
  np.testing.assert_allclose(np.asarray(want[0], np.float32)[finite],
                             np.clip(rows * 3, -float(fp8.max), float(fp8.max))[finite],
                             rtol=float(fp8.eps), atol=float(fp8.smallest_normal))
  # The transposed copy: the rows' bytes with the tokens (batch, position).
  np.testing.assert_array_equal(_bytes(want[1]),
                                _bytes(cast.transpose(want[0], batch=b, implementation="xla")))


def test_transpose_with_batch():
  q = jax.random.normal(jax.random.key(1), (4 * 256, 256)).astype(E4)  # 256 positions x 4
  want = np.asarray(q, np.float32).reshape(256, 4, 256).transpose(2, 1, 0).reshape(256, -1)
  for impl in ("pallas", "xla"):
    np.testing.assert_array_equal(np.asarray(cast.transpose(q, batch=4, implementation=impl),
                                             np.float32), want)
  np.testing.assert_array_equal(_bytes(cast.transpose(q, implementation="pallas")),
                                _bytes(q.T))


def test_split_and_merge_are_inverse():
  y = jnp.arange(4 * 2 * 3 * 2 * 5, dtype=jnp.float32).reshape(4, 2, 30)  # s, b, (h, part, d)
  q, k, v = heads.split_heads(y, 3, 5)
  assert q.shape == (2, 4, 2, 5)
  np.testing.assert_array_equal(k[1, 2, 0], y[2, 1, 5:10])  # batch 1, position 2, head 0
  np.testing.assert_array_equal(heads.merge_heads((q, k, v)), y)


def _inputs(seed, seq, batch, k, heads_, head_dim):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (seq, batch, k))
  w1 = jax.random.normal(keys[1], (k, 3 * heads_ * head_dim)) / np.sqrt(k)
  w2 = jax.random.normal(keys[2], (heads_ * head_dim, k)) / np.sqrt(heads_ * head_dim)
  return x, w1, w2


def _attention_step(mesh, recipe, inside, x, w1, w2, head_dim, **options):
  """loss and gradients of RS(f(split(AG(x) w1)) w2), f a stand-in for
  attention that mixes q, k and v, with the layout inside the ops or XLA's
  copies outside them."""
  batch = x.shape[1]

  def loss(x, w1, w2):
    hist = AmaxHistory.zeros(recipe) if recipe.scaling == "delayed" else None
    if inside:
      q, k, v = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=hist,
                                      split_heads=(3, head_dim, batch), **options)
    else:
      q, k, v = heads.split_heads(fp8_all_gather_matmul(x, w1, "tp", recipe=recipe,
                                                        history=hist, **options), 3, head_dim)
    o = q * jnp.tanh(k) + v * v  # [b, s, h, d]
    if inside:
      y = fp8_matmul_reduce_scatter(o.reshape(-1, o.shape[2] * head_dim), w2, "tp",
                                    recipe=recipe, history=hist,
                                    merge_heads=(head_dim, batch)).reshape(-1, batch, w2.shape[1])
    else:
      y = fp8_matmul_reduce_scatter(heads.merge_heads(o), w2, "tp", recipe=recipe, history=hist)
    return jax.lax.psum(jnp.sum(y * jnp.cos(y)), "tp")

  f = jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                    in_specs=(P("tp"), P(None, "tp"), P("tp")),
                    out_specs=(P(), (P("tp"), P(None, "tp"), P("tp"))))
  return jax.jit(f)(x, w1, w2)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
@pytest.mark.parametrize("options", [{}, {"keep_gathered_input": True},
                                     {"collectives": "ring"}], ids=["xla", "keep", "ring"])
def test_ops_take_attentions_layout(size, scaling, options):
  """The same loss and gradients as XLA's copies outside the ops, with the
  gathered input kept, and on the ring (whose GEMMs take the rows as they
  arrive: XLA splits their output). Two programs: the stand-in's tanh may
  round in its last bits otherwise in each (tests/test_fp8_cast.py), so an
  E4M3 code of its output may flip (the loss), and an E5M2 code of the
  gradients it passes back (dx, dw); tests/tolerance.py has the bound."""
  mesh, recipe = cpu_mesh(size), Fp8Recipe(scaling)
  head_dim = 64
  x, w1, w2 = _inputs(size, 128 * size, 2, 64, 2 * size, head_dim)
  (l_in, (dx_in, dw1_in, dw2_in)) = _attention_step(mesh, recipe, True, x, w1, w2, head_dim,
                                                    **options)
  (l_out, (dx_out, dw1_out, dw2_out)) = _attention_step(mesh, recipe, False, x, w1, w2,
                                                        head_dim, **options)
  tokens = x.shape[0] * x.shape[1]
  assert_fp8_programs_close(l_in, l_out, fmt=E4, k=tokens * w2.shape[1], scale=abs(float(l_out)),
                            what="loss")
  for name, got, want, k in (("dx", dx_in, dx_out, w1.shape[1]), ("dw1", dw1_in, dw1_out, tokens),
                             ("dw2", dw2_in, dw2_out, tokens)):
    assert_fp8_programs_close(got, want, fmt=E5, k=k, what=name)


def test_bad_heads_arguments_are_named():
  mesh = cpu_mesh(1)
  x, w1, w2 = _inputs(0, 128, 2, 64, 2, 64)
  run = lambda f, *a: jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(),
                                    check_vma=False)(*a)
  cases = [
      (lambda x, w: fp8_all_gather_matmul(x, w, "tp", split_heads=(3, 64)),
       "`split_heads` must be \\(parts, head_dim, batch\\)"),
      (lambda x, w: fp8_all_gather_matmul(x, w, "tp", split_heads=(3, 60, 2)),
       "parts \\* head_dim"),
      (lambda x, w: fp8_all_gather_matmul(x, w, "tp", split_heads=(3, 64, 3)),
       "the batch must divide"),
      (lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=Fp8Recipe("row"),
                                          split_heads=(3, 64, 2)), "one scale per tensor"),
      (lambda x, w: fp8_all_gather_matmul(x, w, "tp", return_gathered=True,
                                          split_heads=(3, 64, 2)), "do not combine"),
  ]
  for f, message in cases:
    with pytest.raises(ValueError, match=message):
      run(f, x, w1)
  o = jnp.ones((256, 128))
  for kwargs, message in ((dict(merge_heads=(64,)), "`merge_heads` must be"),
                          (dict(merge_heads=(64, 2), activation=jax.nn.gelu), "do not combine"),
                          (dict(merge_heads=(64, 2), recipe=Fp8Recipe("row")),
                           "one scale per tensor")):
    with pytest.raises(ValueError, match=message):
      run(lambda o, w: fp8_matmul_reduce_scatter(o, w, "tp", **kwargs), o, w2)


@pytest.mark.parametrize("scaling", ["tensor", "delayed", "row"])
def test_block_attention_through_the_ops(scaling):
  """The transformer block under an FP8 recipe: with the layout inside the
  ops (one scale per tensor) its loss and gradients are those of XLA's copies
  outside them; "row" keeps XLA's copies (nothing to compare: the same
  program). Two programs: their LayerNorm, attention and GELU round in their
  own orders, so a code may flip: E4M3 in the forward (the loss), E5M2 in
  what the gradients reach (tests/tolerance.py). A swapped part or a scale
  off by 25% moves a leaf by more (seen: 1.0 and 0.37 of its largest value)."""
  b, s, width, n = 2, 128, 256, 2
  options = tb.BlockOptions(num_heads=n, config=CommGemmConfig(fp8=Fp8Recipe(scaling)))
  layout = tb.param_layout(width, 2 * width, "tp")
  leaves, tree = jax.tree.flatten(layout, is_leaf=lambda v: isinstance(v, tb.ParamSpec))
  keys = jax.random.split(jax.random.key(7), len(leaves))
  params = jax.tree.unflatten(tree, [jax.random.normal(k, p.shape) * 0.05 + (len(p.shape) == 1)
                                     for k, p in zip(keys, leaves)])
  x = jax.random.normal(jax.random.key(8), (s, b, width))
  histories = tb.init_fp8_histories(options)

  def step(axis):  # an axis of its own: the block's jit traces afresh
    mesh = cpu_mesh(2, axis)

    def loss(p, x):
      y = tb.sharded_transformer_block(x, p, mesh=mesh, axis_name=axis, options=options,
                                       fp8_histories=histories)
      return jnp.mean(y ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

  calls = []
  inside = dense.heads_inside
  with mock.patch.object(dense, "heads_inside", lambda *a: calls.append(inside(*a)) or calls[-1]):
    got = step("tp")
  assert calls == [scaling != "row"] * 2  # QKV's and the output projection's
  with mock.patch.object(dense, "heads_inside", lambda *a: False):
    want = step("tp_outside")
  (loss, grads), (loss_want, grads_want) = got, want
  assert_fp8_programs_close(loss, loss_want, fmt=E4, k=x.size, scale=abs(float(loss_want)),
                            what="loss")
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_want)):
    assert_fp8_programs_close(g, w, fmt=E5, k=s * b + 2 * width, what=jax.tree_util.keystr(path))


@pytest.mark.parametrize("n", [3, 1])
def test_cast_heads_column_sums(n):
  """The kernel's float32 column sums (a bias's gradient) are those of x in its
  columns (head, part, head_dim), from the same pass as the casts."""
  b, s, h, d = 2, 128, 2, 64
  keys = jax.random.split(jax.random.key(11), n)
  parts = [(jax.random.normal(k, (b, s, h, d)) * 10 + i).astype(jnp.bfloat16)
           for i, k in enumerate(keys)]
  want = np.stack([np.asarray(p, np.float64) for p in parts], -2).sum(axis=(0, 1)).reshape(-1)
  for impl in ("pallas", "xla"):
    q, qT, amax, sums = heads.cast_heads(parts, 1.0, E5, with_column_sums=True,
                                         implementation=impl)
    assert amax is None and sums.dtype == jnp.float32 and sums.shape == (h * n * d,)
    np.testing.assert_allclose(sums, want, rtol=1e-5, atol=1e-3)
  assert heads.cast_heads(parts, 1.0, E5, implementation="pallas")[3] is None


def _bias_step(mesh, recipe, layout, x, w, bias, ct_seed, head_dim):
  """The column op's output with `bias` inside it (or added after it, None
  layout "outside") and the gradients of <y, c> for a fresh random c."""
  batch = x.shape[1]

  def f(x, w, b):
    hist = AmaxHistory.zeros(recipe) if recipe.scaling == "delayed" else None
    if layout == "heads":
      y = fp8_all_gather_matmul(x, w, "tp", recipe=recipe, history=hist, bias=b,
                                split_heads=(3, head_dim, batch))
      return heads.merge_heads(y)  # [s, b, C]
    if layout == "inside":
      return fp8_all_gather_matmul(x, w, "tp", recipe=recipe, history=hist, bias=b)
    return fp8_all_gather_matmul(x, w, "tp", recipe=recipe, history=hist) + b

  c = jax.random.normal(jax.random.key(ct_seed), (x.shape[0], batch, w.shape[1]))

  def loss_and_y(x, w, b):
    def local(x, w, b, c):
      y = f(x, w, b)
      return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * c), "tp"), y
    return jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"),
                                                     P(None, None, "tp")),
                         out_specs=(P(), P(None, None, "tp")))(x, w, b, c)

  (loss, y), grads = jax.jit(jax.value_and_grad(loss_and_y, argnums=(0, 1, 2),
                                                has_aux=True))(x, w, bias)
  return y, grads, c


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("scaling,layout", [("tensor", "heads"), ("delayed", "heads"),
                                            ("tensor", "inside"), ("row", "inside")])
def test_bias_inside_the_column_op(size, scaling, layout):
  """y = AG(x) w + bias as with the bias added after the op, and the bias's
  gradient, the output gradient's column sums from its cast, float64's sums to
  the rounding of the bias's dtype (bf16), in that dtype. Two programs of the
  same FP8 arithmetic on the inputs' own casts (x, w and c: nothing computed
  before a cast, so no code can flip): their GEMMs' float32 sums apart."""
  mesh, recipe, head_dim = cpu_mesh(size), Fp8Recipe(scaling), 64
  x, w, _ = _inputs(20 + size, 128 * size, 2, 64, 2 * size, head_dim)
  bias = jax.random.normal(jax.random.key(3), (w.shape[1],)).astype(jnp.bfloat16)
  y, (dx, dw, db), c = _bias_step(mesh, recipe, layout, x, w, bias, 30 + size, head_dim)
  y0, (dx0, dw0, _), _ = _bias_step(mesh, recipe, "outside", x, w, bias, 30 + size, head_dim)
  tokens = x.shape[0] * x.shape[1]
  assert_reduction_close(y, y0, k=x.shape[-1], what="y")
  assert_reduction_close(dx, dx0, k=w.shape[1], what="dx")
  assert_reduction_close(dw, dw0, k=tokens, what="dw")
  assert db.dtype == jnp.bfloat16
  want = np.asarray(c, np.float64).sum(axis=(0, 1))
  np.testing.assert_allclose(np.asarray(db, np.float64), want, rtol=2 ** -8, atol=1e-2)


def test_bad_bias_is_named():
  mesh = cpu_mesh(1)
  x, w, _ = _inputs(0, 128, 2, 64, 2, 64)
  for bias in (jnp.ones((w.shape[1] + 1,)), jnp.ones((w.shape[1],), jnp.int32)):
    with pytest.raises(ValueError, match="`bias` must be None or a float vector"):
      jax.shard_map(lambda x, w, b: fp8_all_gather_matmul(x, w, "tp", bias=b), mesh=mesh,
                    in_specs=P(), out_specs=P(), check_vma=False)(x, w, bias)
