"""The gated MLP (SwiGLU, GeGLU) under FP8 as one op: the product
``act(gate) * up`` made inside down's input cast from both halves of gate and
up's GEMM output, and its gradient ``[d gate, d up]`` inside gate and up's
gradient cast (the cast kernel, Pallas's interpreter here, where its tiles
divide the operand). Against float64 written here in plain jax: the kernel's
codes, amaxes and column sums, and the layer's output and every gradient
(x, gate and up's kernel and bias, down's) at TP 1, 2 and 4 under every
recipe; the one op against the ops it replaces (two FP8 programs); which
path the Llama block takes; a bad kernel width named. The GPU runs the
compiled kernel (tests/gpu/one_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.fp8 import (AmaxHistory, Fp8Recipe, cast, fp8_matmul_reduce_scatter,
                               fp8_mlp, prologue)
from jax_comm_gemm.layers import dense, gated_mlp, llama
from jax_comm_gemm.runtime.registry import current_plan
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal
from test_fp8_layer_norm import _kernel_names
from tolerance import assert_fp8_codes_close, assert_fp8_programs_close, fp8_step

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = cast.TILE
SWIGLU = prologue.gated(jax.nn.silu)
DSWIGLU = prologue.activation_gradient(SWIGLU)


def _silu64(g):
  """silu and its derivative in float64."""
  s = 1.0 / (1.0 + np.exp(-g))
  return g * s, s * (1.0 + g * (1.0 - s))


def _kernel_where_tiles_divide(monkeypatch):
  """The cast kernel (Pallas's interpreter) wherever a GPU would run it."""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: all(d % TILE == 0 for d in x.shape))


# --- the kernel ------------------------------------------------------------------------

@pytest.mark.parametrize("backward", [False, True], ids=["swiglu", "dswiglu"])
def test_kernel_reads_and_writes_both_halves(backward):
  """The kernel's pass over gate and up's output (forward: the product; backward:
  from (dy, gate|up) the pair [d gate, d up]) writes XLA's codes for the same
  arithmetic, each within one FP8 step of float64's, with the amax, the
  conditional amax and the column sums of what it casts."""
  r, c = TILE, TILE
  h, dy = _normal(31, [(r, 2 * c), (r, c)], [jnp.bfloat16] * 2)
  h = h * 2  # over silu's curve on both sides
  f, operands = (DSWIGLU, (dy, h)) if backward else (SWIGLU, (h,))
  # float64: silu(g) * u, or [dy * u * silu'(g), dy * silu(g)]
  g, u = (np.asarray(a, np.float64) for a in np.split(np.asarray(h, np.float32), 2, axis=1))
  a, da = _silu64(g)
  d = np.asarray(dy, np.float64)
  ref = np.concatenate([d * u * da, d * a], axis=1) if backward else a * u
  scale = jnp.float32(0.9 * 448 / np.max(np.abs(ref)))  # in range: no saturation
  args = operands if backward else operands[0]
  got = cast.cast_transpose(args, scale, E4, with_amax=True, with_column_sums=True,
                            implementation="pallas", prologue=f)
  want = jax.jit(lambda *a: cast.cast_transpose(
      a if backward else a[0], scale, E4, with_amax=True, with_column_sums=True,
      implementation="xla", prologue=f))(*operands)
  assert_fp8_codes_close(got[0], want[0], what="rows")
  assert_fp8_codes_close(got[1], want[1], what="columns")
  rows = np.asarray(got[0], np.float32) / float(scale)
  # Half an E4M3 step, bf16's rounding before the cast, and the subnormals' step.
  atol = (fp8_step(E4) / 2 + 2.0 ** -8) * np.abs(ref) + 2.0 ** -9 / float(scale)
  assert np.all(np.abs(rows - ref) <= atol), np.max(np.abs(rows - ref) - atol)
  np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8),
                                np.asarray(got[0]).T.view(np.uint8))  # a copy: exact
  assert float(got[2]) == pytest.approx(np.max(np.abs(ref)), rel=2.0 ** -7)
  np.testing.assert_allclose(np.asarray(got[3]), ref.sum(0), rtol=0,
                             atol=1e-2 * np.max(np.abs(ref.sum(0))))
  amax = cast.amax_if(args, jnp.bool_(True), implementation="pallas", prologue=f)
  assert float(amax) == float(got[2])  # maxima of the same rounded values: exact


# --- the layer against float64 ---------------------------------------------------------

def _inputs(seed, n, k, f):
  """bf16 x, kernels and biases (the layer takes one dtype), float32 ct."""
  x, w1, b1, w2, b2, ct = _normal(seed, [(n, k), (k, 2, f), (2, f), (f, k), (k,), (n, k)],
                                  [jnp.float32] * 6)
  # gate and up of order 1, over silu's curve on both sides
  bf = lambda a: a.astype(jnp.bfloat16)
  return bf(x), bf(w1 / np.sqrt(k) * 2), bf(b1 * 0.5), bf(w2 / np.sqrt(f)), bf(b2 * 0.1), ct


def _reference(x, w1, b1, w2, b2, ct):
  """(y, dx, d gate_up kernel, d gate_up bias, d down kernel, d down bias) in
  float64, and [d gate, d up]."""
  x, w1, b1, w2, b2, ct = (np.asarray(a, np.float64) for a in (x, w1, b1, w2, b2, ct))
  g, u = x @ w1[:, 0] + b1[0], x @ w1[:, 1] + b1[1]
  a, da = _silu64(g)
  p = a * u
  dp = ct @ w2.T
  dg, du = dp * u * da, dp * a
  dw1 = np.stack([x.T @ dg, x.T @ du], 1)
  dx = dg @ w1[:, 0].T + du @ w1[:, 1].T
  return (p @ w2 + b2, dx, dw1, np.stack([dg.sum(0), du.sum(0)]), p.T @ ct, ct.sum(0)), \
      np.concatenate([dg, du], 1)


def _run(mesh, config, x, w1, b1, w2, b2, ct, bias, mlp=None):
  """(y, dx, dw1, db1, dw2, db2, next histories) of jit(value_and_grad(sum(y * ct)))
  of `mlp` (gated_mlp's signature; gated_mlp by default) on `mesh`."""
  mlp = mlp or gated_mlp.gated_mlp
  delayed = config.fp8 is not None and config.fp8.scaling == "delayed"
  size = mesh.shape["tp"]
  # Each rank its own copy of a history (check_vma=False sums a replicated one's gradient).
  hs = (jax.tree.map(lambda a: jnp.stack([a] * size), dense.init_mlp_fp8_histories(config))
        if delayed else None)

  def f(x, w1, b1, w2, b2, hs):
    return mlp(x, w1, w2, b1 if bias else None, b2 if bias else None, axis_name="tp",
               config=config, fp8_histories=jax.tree.map(lambda a: a[0], hs))
  specs = (P("tp"), P(None, None, "tp"), P(None, "tp"), P("tp"), P(), P("tp"))
  g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("tp"), check_vma=False)
  loss = lambda *a: jnp.sum(g(*a).astype(jnp.float32) * ct)
  y = jax.jit(g)(x, w1, b1, w2, b2, hs)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(x, w1, b1, w2, b2, hs)
  return (y, *grads[:5], jax.tree.map(lambda a: a[0], grads[5]))


# (scaling, tp, bias): every recipe; TP 1, 2 and 4 on the kernel.
CASES = [("tensor", 1, False), ("tensor", 2, True), ("tensor", 4, False),
         ("delayed", 2, True), ("row", 2, False), ("block", 1, True)]


@pytest.mark.parametrize("scaling, tp, bias", CASES,
                         ids=[f"{s}-tp{t}{'-bias' if b else ''}" for s, t, b in CASES])
def test_gated_mlp_matches_float64(monkeypatch, scaling, tp, bias):
  """Two FP8 GEMMs in a row (as tests/test_fp8_mlp_op.py): each output within
  its last GEMM's tolerance doubled; gate and up's bias, a sum over tokens,
  within the data gradient's, as fc1's bias there; "block": the weight
  gradients' doubled again (its requantized operand). Delayed scaling records
  [d gate, d up]'s amax from the kernel's pass."""
  _kernel_where_tiles_divide(monkeypatch)
  mesh = cpu_mesh(tp)
  n, k, f = TILE, TILE, TILE * tp  # every shard's hidden width one tile: the kernel runs
  x, w1, b1, w2, b2, ct = _inputs(41 + tp, n, k, f)
  config = CommGemmConfig(fp8=Fp8Recipe(scaling))
  got = _run(mesh, config, x, w1, b1, w2, b2, ct, bias)
  refs, dp = _reference(x, w1, b1 if bias else 0 * b1, w2, b2 if bias else 0 * b2, ct)
  tol_dw = TOL_DW[("row" if scaling == "row" else "tensor", "ag")]
  tol_dw = tol_dw if scaling != "block" else 2 * tol_dw
  # down's bias: y's gradient rounded to bf16 and summed over the tokens, no FP8: a
  # few of bf16's roundings (2**-8 each).
  tols = (2 * TOL_FORWARD, 2 * TOL_DX, 2 * tol_dw, TOL_DX, tol_dw, 4 * 2.0 ** -8)
  names = ("y", "dx", "d gate_up", "d gate_up bias", "d down", "d down bias")
  for name, g, r, tol in list(zip(names, got, refs, tols))[:6 if bias else 5]:
    if name == "d gate_up bias" and not bias:
      continue
    assert _err(g, r) <= tol, f"{name}: error {_err(g, r):.4f} > tolerance {tol:.4f}"
  if scaling == "delayed":  # [d gate, d up]'s amax, from the pass that made it
    amax = np.max(np.abs(dp))
    assert abs(float(got[6]["fc1"].dy[0]) - amax) <= TOL_DX * amax


def test_the_one_op_equals_the_ops_it_replaces(monkeypatch):
  """Delayed scaling, TP 2, on the kernel: the one op against gate and up's
  column-parallel op, XLA's product in bf16, and down's row-parallel op: the
  same FP8 arithmetic in two programs, whose products and their gradients
  round otherwise (XLA's bf16 passes against float32 rounded once), so a code
  may flip (tests/tolerance.py: E4M3 forward, E5M2 in the gradients and the
  histories' amaxes)."""
  _kernel_where_tiles_divide(monkeypatch)
  mesh = cpu_mesh(2)
  n, k, f = 2 * TILE, TILE, 2 * TILE
  x, w1, b1, w2, b2, ct = _inputs(43, n, k, f)
  config = CommGemmConfig(fp8=Fp8Recipe("delayed"))

  def two_ops(x, w1, w2, b1, b2, *, axis_name, config, fp8_histories):
    plan = current_plan()  # as an entry reads it
    h = dense.column_parallel(x, gated_mlp.flat(w1), None, axis_name=axis_name,
                              config=config, fp8_history=fp8_histories["fc1"], plan=plan)
    a = gated_mlp.gated(jax.nn.silu)(h)  # XLA's pass, written in bf16
    return dense.row_parallel(a, w2, None, axis_name=axis_name, config=config,
                              fp8_history=fp8_histories["fc2"], plan=plan)
  one = _run(mesh, config, x, w1, b1, w2, b2, ct, False)
  two = _run(mesh, config, x, w1, b1, w2, b2, ct, False, mlp=two_ops)
  fl = f // 2  # a shard's hidden width
  for name, a, b, fmt, red in zip(("y", "dx", "d gate_up", "d down"),
                                  (one[0], one[1], one[2], one[4]),
                                  (two[0], two[1], two[2], two[4]),
                                  (E4, E5, E5, E5), (k + fl, 2 * fl + k, n, n)):
    assert_fp8_programs_close(a, b, fmt=fmt, k=red, what=name)
  for layer in ("fc1", "fc2"):
    for field, a, b in zip(AmaxHistory._fields, one[6][layer], two[6][layer]):
      assert_fp8_programs_close(a, b, fmt=E5, k=k + 2 * fl, what=f"{layer} amax {field}")


# --- which path the Llama block takes --------------------------------------------------

def _block_jaxpr(config, grad):
  D, F = TILE, TILE
  options = llama.LlamaOptions(2, 1, dtype=jnp.bfloat16, config=config)
  layout = llama.param_layout(D, F, options, "tp")
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.05), layout)
  hs = llama.init_fp8_histories(options)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  f = jax.shard_map(lambda x, p, h: llama.llama_block(x, p, axis_name="tp", options=options,
                                                      fp8_histories=h),
                    mesh=mesh, in_specs=(P("tp"), llama.partition_specs(layout), P()),
                    out_specs=P("tp"), check_vma=False)
  x = jnp.ones((TILE, 1, D), jnp.bfloat16)
  if grad:
    return jax.make_jaxpr(jax.grad(lambda p: jnp.sum(f(x, p, hs).astype(jnp.float32))))(params)
  return jax.make_jaxpr(f)(x, params, hs)


def _one_op(closed) -> bool:
  """Whether the block calls fp8_mlp's custom_vjp (under the op's name scope)
  and computes no product of its own (XLA's runs under the scope "activation")."""
  calls = [e for e in _eqns(closed.jaxpr) if e.primitive.name.startswith("custom_vjp")
           and "fp8_mlp" in str(e.source_info.name_stack)]
  own = [e for e in _eqns(closed.jaxpr) if "activation" in str(e.source_info.name_stack)
         and "fp8_mlp" not in str(e.source_info.name_stack)]
  return bool(calls) and not own


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _eqns(sub)


@pytest.mark.parametrize("scaling", ["tensor", "delayed", "row", "block"])
def test_llama_block_takes_the_one_op(monkeypatch, scaling):
  """Under every recipe the block's MLP is the one op (fp8_mlp's custom_vjp);
  with one scale per tensor its casts are the kernels that make the product
  (forward) and [d gate, d up] (backward, with the conditional amax under
  "delayed"); per-row and block scales make them in XLA's fusion of the cast
  (no kernel). bf16 has no FP8 op."""
  _kernel_where_tiles_divide(monkeypatch)
  config = CommGemmConfig(fp8=Fp8Recipe(scaling))
  assert _one_op(_block_jaxpr(config, False))
  names = list(_kernel_names(_block_jaxpr(config, True).jaxpr))
  glu = sorted(n for n in names if n.endswith("swiglu"))
  if scaling in ("tensor", "delayed"):
    assert "fp8_cast_rows_columns_swiglu" in glu or "fp8_cast_rows_columns_amax_swiglu" in glu
    assert any(n.startswith("fp8_cast_rows_columns") and n.endswith("_dswiglu")
               for n in glu), glu
  else:
    assert glu == [], glu
  assert not _one_op(_block_jaxpr(CommGemmConfig(), False))


@pytest.mark.parametrize("op, match", [
    (lambda x: fp8_mlp(x, jnp.ones((TILE, 3)), None, jnp.ones((1, TILE)), "tp",
                       activation=SWIGLU), "`w1` must be \\[k, 2F/P\\]"),
    (lambda x: fp8_matmul_reduce_scatter(x, jnp.ones((TILE, TILE)), "tp", activation=SWIGLU),
     "a gated `activation` \\(swiglu\\).*use fp8_mlp")], ids=["odd_width", "row_op"])
def test_bad_input_is_named(op, match):
  with pytest.raises(ValueError, match=match):
    jax.shard_map(op, mesh=cpu_mesh(1), in_specs=P("tp"), out_specs=P("tp"),
                  check_vma=False)(jnp.ones((TILE, TILE), jnp.bfloat16))


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep"])
def test_gathers_as_the_gelu_mlp(keep):
  """The one op gathers as the GELU MLP's (tests/test_fp8_hlo.py, fused gathers
  opaque): two fused gathers of FP8 bytes (gate and up's forward, down's
  dgrad) and one standalone all-gather (gate and up's re-gather for their
  weight gradient), none with keep_gathered_input."""
  from test_fp8_hlo import _LHS, SCOPE, opaque_gather
  mesh = cpu_mesh(2)
  n, k, f = 4 * TILE, TILE, 2 * TILE
  x = jnp.ones((n, k), jnp.bfloat16)
  counts = {}
  for name, act, w1 in (("gated", SWIGLU, jnp.ones((k, 2 * f))),
                        ("gelu", jax.nn.gelu, jnp.ones((k, f)))):
    g = jax.shard_map(lambda x, w1, w2, act=act: fp8_mlp(
        x, w1, None, w2, "tp", activation=act, keep_gathered_input=keep, gather=opaque_gather),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    step = jax.jit(jax.grad(lambda *a: jnp.sum(g(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    ops = [(m.group(2), SCOPE in line)
           for line in step.lower(x, w1, jnp.ones((f, k))).compile().as_text().splitlines()
           if (m := _LHS.search(line)) and m.group(2).startswith("all-gather")]
    counts[name] = (sum(scoped for _, scoped in ops), sum(not scoped for _, scoped in ops))
  assert counts["gated"] == counts["gelu"] == (2, 0 if keep else 1), counts
