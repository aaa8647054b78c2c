"""The Llama-class block under every FP8 recipe against the float64 reference
of tests/test_llama.py, and its RMSNorms inside the FP8 casts (the cast
kernel, Pallas's interpreter here, normalizes as it casts).

Tolerances (docs/fp8.md, "Tolerances"): the output within one forward GEMM's
(E4M3 x E4M3, the residual carries the rest); each gradient within the
recipe's largest per-GEMM gradient tolerance times sqrt(2): it passes through
at least two FP8 GEMMs (its own and the data gradient that made its output
gradient), whose independent roundings add in quadrature."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.fp8 import Fp8Recipe, cast, prologue
from jax_comm_gemm.layers import llama
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, _err
from test_fp8_layer_norm import _kernel_names
from test_llama import random_params, reference

# d 128, 2 query heads of 64 over 1 key/value head, hidden 128, 128 tokens:
# "block" scaling's blocks of 128 in every GEMM dim (at tp 1).
D, HEADS, KV, F, SEQ = 128, 2, 1, 128, 128


def _run(scaling, tp):
  options = llama.LlamaOptions(HEADS, KV, dtype=jnp.bfloat16,
                               config=CommGemmConfig(fp8=Fp8Recipe(scaling)))
  params = random_params(llama.param_layout(D, F, options, "tp", tp), seed=1)
  kx, kc = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (SEQ, 1, D)).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (SEQ, 1, D))
  mesh = cpu_mesh(tp)
  histories = llama.init_fp8_histories(options)

  def loss(p, x):
    y = llama.sharded_llama_block(x, p, mesh=mesh, options=options,
                                  fp8_histories=histories)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return (y, grads), reference(params, np.asarray(x, np.float32), ct, heads=HEADS,
                               kv_heads=KV)


@pytest.mark.parametrize("scaling", ["tensor", "delayed", "row", "block"])
def test_block_within_the_fp8_tolerance(scaling):
  _check(*_run(scaling, 1 if scaling == "block" else 2), scaling)


def _check(got, want, scaling):
  (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = got, want
  per_tensor = scaling in ("tensor", "delayed")
  tol = np.sqrt(2) * max(TOL_DX, *(v for (s, _), v in TOL_DW.items()
                                   if s == ("tensor" if per_tensor else "row")))
  assert _err(y, y_ref) <= TOL_FORWARD, f"y: {_err(y, y_ref):.4f}"
  assert _err(dx, dx_ref) <= tol, f"dx: {_err(dx, dx_ref):.4f}"
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(dp), jax.tree.leaves(dp_ref)):
    assert _err(g, r) <= tol, f"d{jax.tree_util.keystr(path)}: {_err(g, r):.4f} > {tol:.4f}"


def test_rms_norms_inside_the_casts(monkeypatch):
  """Under delayed FP8 the cast kernel computes both RMSNorms' outputs as it
  casts them (two kernels named so; none with the RMSNorms before the ops),
  and the block stays within its FP8 tolerance of float64."""
  monkeypatch.setattr(cast, "_kernel_runs", lambda x: True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  options = llama.LlamaOptions(HEADS, KV, dtype=jnp.bfloat16,
                               config=CommGemmConfig(fp8=Fp8Recipe("delayed")))
  layout = llama.param_layout(D, F, options, "tp")
  params = random_params(layout, seed=2)
  kx, kc = jax.random.split(jax.random.key(7))
  x = jax.random.normal(kx, (SEQ, 1, D)).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (SEQ, 1, D))
  h = llama.init_fp8_histories(options)

  def block():
    """(kernels named *_rms_norm, the block), traced afresh."""
    f = jax.shard_map(lambda x, p, h: llama.llama_block(x, p, axis_name="tp",
                                                        options=options, fp8_histories=h),
                      mesh=mesh, in_specs=(P("tp"), llama.partition_specs(layout), P()),
                      out_specs=P("tp"), check_vma=False)
    names = [n for n in _kernel_names(jax.make_jaxpr(f)(x, params, h).jaxpr)
             if n.endswith("_rms_norm")]
    return len(names), f

  kernels, f = block()
  assert kernels == 2

  def loss(p, x):
    y = f(x, p, h)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  _check((y, grads), reference(params, np.asarray(x, np.float32), ct, heads=HEADS,
                               kv_heads=KV), "delayed")
  operands, rms = llama.rms_operands, prologue.rms_norm
  monkeypatch.setattr(llama, "rms_operands", lambda *a: (
      prologue.activated(operands(*a), rms).astype(a[-1]),))
  monkeypatch.setattr(prologue, "rms_norm", None)
  assert block()[0] == 0
