"""A route carries what its backward binds with: a ``jax.vjp`` taken under one
plan runs its backward under that plan's backend, layout and reuse verdict,
wherever (under whichever plan) the backward is called. On CPU the fused
primitive lowers to XLA's collectives, so the gradients are checked too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.runtime.plan as plan_lib
from conftest import stand_in_plan
from jax_comm_gemm.runtime.capability import Capability, VerdictKey
from jax_comm_gemm.runtime.constants import GATHERED_LAYOUTS, TARGETS

FUSED_AG = TARGETS["all_gather_matmul"]


def _plan(mesh, layout: str, reuse: bool):
  """cuBLASMp "runs", axis tp connected, the gathered operand's verdict
  passing (`reuse`) for the row-parallel backward's AllGather+GEMM."""
  verdicts = {VerdictKey(2, "split_p2p", "float32", transpose, layout):
              Capability(reuse, "stand-in verdict") for transpose in (False, True)}
  return stand_in_plan(layout=layout, autotune="off").with_axis(mesh, "tp", 7, verdicts)


def _row_parallel(mesh):
  config = jcg.CommGemmConfig(backend="cublasmp", reduce_scatter="split_p2p")
  return jax.jit(jax.shard_map(
      lambda x, w: jcg.matmul_reduce_scatter(x, w, "tp", config=config), mesh=mesh,
      in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))


def _fused_layouts(jaxpr) -> list[int]:
  """The layout of each fused AllGather+GEMM in `jaxpr` (nested ones too)."""
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == FUSED_AG:
        found.append((eqn.params["layout"], eqn.params["return_gathered"]))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("elsewhere", ["outside", "another plan"])
def test_a_vjp_taken_under_one_plan_runs_its_backward_under_it(elsewhere):
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  rng = np.random.default_rng(3)
  x = rng.standard_normal((8, 6)).astype(np.float32)
  w = rng.standard_normal((6, 4)).astype(np.float32)
  ct = rng.standard_normal((8, 4)).astype(np.float32)
  tail = _plan(mesh, "tail", reuse=True)
  with plan_lib.use(tail):
    y, backward = jax.vjp(_row_parallel(mesh), x, w)
  # Where the backward runs, the plan in force has no passing verdict (and the
  # other plan another layout): a bind that read it would refuse the gathered
  # operand or take the other layout.
  other = _plan(mesh, "front", reuse=False)
  if elsewhere == "outside":
    dx, dw = backward(ct)
    jaxpr = jax.make_jaxpr(backward)(ct)
  else:
    with plan_lib.use(other):
      dx, dw = backward(ct)
      jaxpr = jax.make_jaxpr(backward)(ct)
  assert _fused_layouts(jaxpr) == [(GATHERED_LAYOUTS["tail"], True)]
  x64, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
  np.testing.assert_allclose(y, x64 @ w64, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, ct64 @ w64.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, x64.T @ ct64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("where", ["global", "local"])
def test_the_transformer_block_reads_the_plan_at_its_entry_alone(monkeypatch, fp8, where):
  """A forward and backward of the transformer block on cuBLASMp's route (or
  FP8's): the plan in force is read once, where the block's program is built,
  and passed down to every op."""
  from call_path import forget_traces, traced
  from fake_native import install_fake_native
  from jax_comm_gemm.fp8 import Fp8Recipe
  from jax_comm_gemm.layers import transformer

  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  install_fake_native(monkeypatch)
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  config = (jcg.CommGemmConfig(backend="xla", fp8=Fp8Recipe()) if fp8 else
            jcg.CommGemmConfig(backend="cublasmp", reduce_scatter="split_p2p"))
  options = transformer.BlockOptions(num_heads=2, config=config)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.05, jnp.float32),
                        transformer.param_layout(16, 48, "tp"))
  x = jnp.ones((6, 1, 16), jnp.float32)
  if where == "global":
    block = lambda x, p: transformer.sharded_transformer_block(x, p, mesh=mesh,
                                                               options=options)
    entry = "block_global"
  else:
    block = jax.shard_map(
        lambda x, p: transformer.transformer_block(x, p, axis_name="tp", options=options),
        mesh=mesh, in_specs=(P("tp"), transformer.partition_specs(params, "tp")),
        out_specs=P("tp"))
    entry = "block_local"
  step = jax.jit(jax.grad(lambda x, p: jnp.sum(block(x, p) ** 2), argnums=(0, 1)))
  forget_traces()
  _, reads = traced(lambda: step.lower(x, params))
  assert reads == {("jax_comm_gemm/layers/transformer.py", entry)}
