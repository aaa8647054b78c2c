"""The MLP's activation inside the FP8 cast of the row-parallel op, on CPU:
the kernel (Pallas's interpreter here) applies the prologue and writes the
bytes that XLA's cast of the activation's output would; the amaxes are of
that output; ``fp8_matmul_reduce_scatter(activation=)`` matches float64 in
its output and both gradients (through the activation, recomputed in the
backward) for every recipe, with the kernel as with XLA's casts; and the
transformer block's activation runs inside the cast kernel, not before it
(the GPU runs the compiled kernel: tests/gpu/one_gpu.py). Beside it, the
block's other saved pass: float32 master kernels reach the FP8 ops as they
are, with no bfloat16 copy made of them or of their gradients."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm.fp8 import AmaxHistory, Fp8Recipe, cast, fp8_matmul_reduce_scatter, prologue
from jax_comm_gemm.layers import transformer as tb
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal
from test_fp8_cast import _bytes, assert_codes_match_but_tanh_tail
from tolerance import assert_fp8_programs_close

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = cast.TILE
C = np.sqrt(2 / np.pi)


def _gelu64(x):
  """jax.nn.gelu (tanh form) and its derivative, in float64."""
  t = np.tanh(C * (x + 0.044715 * x ** 3))
  return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * C * (1 + 3 * 0.044715 * x ** 2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("f8", [E4, E5])
@pytest.mark.parametrize("outputs", [dict(), dict(rows=False, with_amax=True),
                                     dict(with_amax=True)])
def test_kernel_casts_the_activations_output(dtype, f8, outputs):
  x = (jax.random.normal(jax.random.key(3), (2 * TILE, 3 * TILE), jnp.float32) * 4).astype(dtype)
  scale = jnp.float32(37.0)
  got = cast.cast_transpose(x, scale, f8, implementation="pallas", prologue=jax.nn.gelu,
                            **outputs)
  # Compiled, as the kernel's interpreted body is: jax 0.12's CPU computes tanh in
  # a compiled program other than op by op (0.2% of E5M2 codes apart).
  fused_xla = jax.jit(lambda x: cast.cast_transpose(x, scale, f8, implementation="xla",
                                                    prologue=jax.nn.gelu, **outputs))(x)
  a = jax.jit(lambda x: jax.nn.gelu(x.astype(jnp.float32)).astype(dtype))(x)  # its output
  unfused = cast.cast_transpose(a, scale, f8, implementation="xla", **outputs)
  tail = np.asarray(x, np.float32) < -2  # where float32's 1 + tanh cancels
  for g, fx, u, t in zip(got, fused_xla, unfused, (tail, tail.T)):
    assert (g is None) == (u is None)
    if g is None:
      continue
    assert_codes_match_but_tanh_tail(g, u, t)
    assert_codes_match_but_tanh_tail(fx, u, t)
  if outputs.get("with_amax"):
    assert float(got[2]) == float(jnp.max(jnp.abs(a.astype(jnp.float32))))


@pytest.mark.parametrize("wanted", [True, False])
def test_conditional_amax_is_of_the_activations_output(wanted):
  x = jax.random.normal(jax.random.key(4), (TILE, 2 * TILE), jnp.bfloat16) * 3
  a = jax.nn.gelu(x.astype(jnp.float32)).astype(x.dtype)
  want = float(jnp.max(jnp.abs(a.astype(jnp.float32)))) if wanted else 0.0
  for impl in ("pallas", "xla"):
    got = cast.amax_if(x, jnp.bool_(wanted), implementation=impl, prologue=jax.nn.gelu)
    assert float(got) == want, impl


def _step(mesh, recipe, history=None, activation=jax.nn.gelu, outside=False):
  """(y, dx, dw[, next history]) of ``RS(act(x) @ w)`` under
  jit(grad(sum(y * ct))); `outside`: the activation applied before the op."""
  def f(x, w, *h):
    hist = {"history": AmaxHistory(*(a[0] for a in h[0]))} if h else {}
    if outside:
      return fp8_matmul_reduce_scatter(activation(x), w, "tp", recipe=recipe, **hist)
    return fp8_matmul_reduce_scatter(x, w, "tp", recipe=recipe, activation=activation, **hist)
  specs = (P(None, "tp"), P("tp")) + ((P("tp"),) if history is not None else ())
  g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("tp"), check_vma=False)
  size = mesh.shape["tp"]

  def loss(x, w, ct, *h):
    return jnp.sum(g(x, w, *h).astype(jnp.float32) * ct)

  def run(x, w, ct):
    args = (x, w, ct)
    if history is not None:  # each rank its own copy (check_vma=False sums a replicated one)
      args += (AmaxHistory(*(jnp.stack([a] * size) for a in history)),)
    argnums = (0, 1, 3) if history is not None else (0, 1)
    y = jax.jit(g)(*args[:2], *args[3:])
    grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    out = (y,) + tuple(grads[:2])
    if history is not None:
      out += (AmaxHistory(*(a[0] for a in grads[2])),)
    return out
  return run


def _inputs(seed, n, k, m):
  x, w, ct = _normal(seed, [(n, k), (k, m), (n, m)], [jnp.bfloat16, jnp.float32, jnp.float32])
  return x * 2, w, ct  # pre-activations spread over GELU's curve, negatives too


# The kernel casts with one scale per tensor; per-row and block scales are XLA's.
@pytest.mark.parametrize("scaling, kernel", [
    ("tensor", False), ("tensor", True), ("delayed", False), ("delayed", True),
    ("row", False), ("block", False)])
def test_op_with_activation_matches_float64(monkeypatch, scaling, kernel):
  size = 2
  mesh = cpu_mesh(size)
  n, k, m = 2 * TILE * size, TILE * size, 2 * TILE
  x, w, ct = _inputs(11, n, k, m)
  recipe = Fp8Recipe(scaling)
  if kernel:
    monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  history = AmaxHistory.zeros(recipe) if scaling == "delayed" else None
  got = _step(mesh, recipe, history)(x, w, ct)
  a, da = _gelu64(np.asarray(x, np.float64))
  w64, ct64 = np.asarray(w, np.float64), np.asarray(ct, np.float64)
  ref = (a @ w64, (ct64 @ w64.T) * da, a.T @ ct64)
  tol_dw = TOL_DW[("row" if scaling == "row" else "tensor", "rs")]
  tol_dw = tol_dw if scaling != "block" else 2 * tol_dw
  for name, g, r, tol in zip(("y", "dx", "dw"), got, ref, (TOL_FORWARD, TOL_DX, tol_dw)):
    assert _err(g, r) <= tol, f"{name}: error {_err(g, r):.4f} > tolerance {tol:.4f}"
  # The same arithmetic as the activation applied before the op (its output
  # rounded to x's dtype there too), in another program: GELU's tanh may round
  # otherwise in its last bits, so a code may flip, E4M3 in the forward, E5M2
  # in the activation's gradient (tests/tolerance.py).
  outside = _step(mesh, recipe, history, outside=True)(x, w, ct)
  for name, g, o, fmt, red in zip(("y", "dx", "dw"), got[:3], outside[:3], (E4, E5, E5),
                                  (k, m, n)):
    assert_fp8_programs_close(g, o, fmt=fmt, k=red, what=name)
  if history is not None:  # the history records the activation's output's amax
    want = float(jnp.max(jnp.abs(jax.nn.gelu(x.astype(jnp.float32)).astype(x.dtype)
                                 .astype(jnp.float32))))
    assert float(got[3].x[0]) == want


@pytest.mark.parametrize("scaling", ["tensor", "delayed"])
def test_scale_is_from_the_activations_amax(scaling):
  """The amax that scales the cast is the activation's output's, not x's:
  here x's is 40 (a negative pre-activation), GELU's output's under 1.1."""
  from jax_comm_gemm.fp8 import steps
  x = jnp.full((TILE, TILE), 0.5, jnp.bfloat16).at[0, 0].set(-40.0).at[1, 1].set(1.0)
  recipe = Fp8Recipe(scaling)
  s = steps.Static("tp", recipe, False, x.dtype, jnp.float32)
  h = (AmaxHistory.zeros(recipe).x,) if scaling == "delayed" else None
  f = jax.shard_map(lambda x: steps.scaling_amaxes(s, h, (x,), prologues=(jax.nn.gelu,))[0],
                    mesh=cpu_mesh(1), in_specs=P(), out_specs=P(), check_vma=False)
  want = float(jnp.max(jnp.abs(prologue.activated(x, jax.nn.gelu).astype(jnp.float32))))
  assert float(f(x)) == want < 1.1


def test_gradient_goes_through_the_activation(monkeypatch):
  """dx is the activation's vjp of the GEMM's: with relu, zero where x < 0."""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  mesh = cpu_mesh(2)
  x, w, ct = _inputs(12, 2 * TILE * 2, TILE * 2, 2 * TILE)
  _, dx, _ = _step(mesh, Fp8Recipe("tensor"), activation=jax.nn.relu)(x, w, ct)
  dx, x = np.asarray(dx, np.float32), np.asarray(x, np.float32)
  assert np.all(dx[x < 0] == 0) and np.count_nonzero(dx[x > 0]) > 0.9 * np.sum(x > 0)


def _eqns(jaxpr, inside=False):
  """(primitive name, inside a pallas_call) of every equation, nested ones too."""
  for e in jaxpr.eqns:
    yield e.primitive.name, inside
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _eqns(sub, inside or e.primitive.name == "pallas_call")


def block_tanh_sites(config, *, grad: bool = False):
  """For each tanh that the transformer block's forward (`grad`: its value and
  gradient) computes, whether it is inside a pallas_call (2 heads, one rank)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  params = jax.tree.map(lambda s: jnp.ones(s.shape, jnp.bfloat16) * 0.01,
                        tb.param_layout(TILE, 2 * TILE, "tp"))
  x = jnp.ones((TILE, 1, TILE), jnp.bfloat16)
  options = tb.BlockOptions(num_heads=2, config=config)
  h = tb.init_fp8_histories(options)
  f = jax.shard_map(lambda x, p, h: tb.transformer_block(x, p, axis_name="tp",
                                                          options=options, fp8_histories=h),
                    mesh=mesh, in_specs=(P("tp"), tb.partition_specs(params, "tp"), P()),
                    out_specs=P("tp"), check_vma=False)
  loss = lambda p, x, h: jnp.sum(f(x, p, h).astype(jnp.float32))
  traced = jax.value_and_grad(loss, argnums=(0, 2)) if grad else (lambda p, x, h: f(x, p, h))
  return [inside for name, inside in _eqns(jax.make_jaxpr(traced)(params, x, h).jaxpr)
          if name == "tanh"]


def test_block_applies_its_activation_inside_the_cast(monkeypatch):
  """The transformer block's forward under delayed FP8 computes GELU's tanh
  only inside the kernels (the cast and the first step's amax: its output is
  never written in bf16); in bf16 outside. ("tensor" also reads it in XLA's
  amax reduction, which fuses it and writes nothing.)"""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  from jax_comm_gemm import CommGemmConfig
  assert set(block_tanh_sites(CommGemmConfig(fp8=Fp8Recipe("delayed")))) == {True}
  assert set(block_tanh_sites(CommGemmConfig())) == {False}


def _converted_kernels(config, kernel_shapes, new_dtype):
  """The shapes of the block's kernel-shaped arrays that its value-and-grad
  converts between float32 and bfloat16 into `new_dtype` (f32 parameters, bf16
  compute; 512 tokens, so that no activation has a kernel's shape)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  layout = tb.param_layout(TILE, 2 * TILE, "tp")
  params = jax.tree.map(lambda s: jnp.ones(s.shape, jnp.float32) * 0.01, layout)
  options = tb.BlockOptions(num_heads=2, dtype=jnp.bfloat16, config=config)
  h = tb.init_fp8_histories(options)
  f = jax.shard_map(lambda x, p, h: tb.transformer_block(x, p, axis_name="tp", options=options,
                                                          fp8_histories=h),
                    mesh=mesh, in_specs=(P("tp"), tb.partition_specs(params, "tp"), P()),
                    out_specs=P("tp"), check_vma=False)
  loss = lambda p, x, h: jnp.sum(f(x, p, h).astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params, jnp.ones((4 * TILE, 1, TILE)), h)
  found = set()

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "convert_element_type":
        shape = tuple(e.invars[0].aval.shape)
        if shape in kernel_shapes and {e.invars[0].aval.dtype, e.params["new_dtype"]} == {
            jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)} and (
            e.params["new_dtype"] == jnp.dtype(new_dtype)):
          found.add(shape)
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  return found


def test_fp8_block_takes_float32_kernels_as_they_are():
  """Under an FP8 recipe the block hands its float32 kernels to the FP8 ops,
  which cast them to FP8 in one read: no bfloat16 copy of a kernel (bf16
  compute makes one of each). Their gradients leave the GEMM in bfloat16, as
  bf16 compute's do, and are widened to float32 where they are read."""
  from jax_comm_gemm import CommGemmConfig
  shapes = {(TILE, 3 * TILE), (TILE, TILE), (TILE, 2 * TILE), (2 * TILE, TILE)}
  assert _converted_kernels(CommGemmConfig(), shapes, jnp.bfloat16) == shapes
  assert _converted_kernels(CommGemmConfig(), shapes, jnp.float32) == shapes
  for scaling in ("tensor", "delayed"):
    config = CommGemmConfig(fp8=Fp8Recipe(scaling))
    assert _converted_kernels(config, shapes, jnp.bfloat16) == set()
    assert _converted_kernels(config, shapes, jnp.float32) == shapes
