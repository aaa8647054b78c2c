"""jcg.hlo.compiled_collectives counts every kind of collective a compiled
program holds: the ring's collective-permutes, all-to-alls, and the gathers,
reduce-scatters and all-reduces (one per operand of a combined one)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh


def test_the_ring_counts_its_collective_permutes():
  """backend="ring", forward only, on tp=4: the AllGather+GEMM ring and the
  GEMM+ReduceScatter ring take P - 1 steps each, and XLA keeps each step's
  collective-permute. No all-gather, no reduce-scatter."""
  size = 4
  mesh = cpu_mesh(size)
  config = jcg.CommGemmConfig(backend="ring")
  x, w1, w2 = jnp.ones((64, 16)), jnp.ones((16, 32)), jnp.ones((32, 16))
  step = jax.jit(jax.shard_map(
      lambda x, w1, w2: jcg.mlp(x, w1, w2, axis_name="tp", config=config), mesh=mesh,
      in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp")))
  counted = jcg.hlo.compiled_collectives(step, x, w1, w2)
  text = step.lower(x, w1, w2).compile().as_text()
  in_text = sum(" collective-permute(" in line or " collective-permute-start(" in line
                for line in text.splitlines())
  assert counted.collective_permute == in_text >= 2 * (size - 1), (counted, in_text)
  assert counted.all_gather == counted.reduce_scatter == 0, counted


def test_all_to_all_and_combined_all_reduce():
  mesh = cpu_mesh(4)
  step = jax.jit(jax.shard_map(
      lambda x, y: (lax.all_to_all(x, "tp", 0, 0, tiled=True), lax.psum((x, y), "tp")),
      mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=(P("tp"), P())))
  counted = jcg.hlo.compiled_collectives(step, jnp.ones((16, 4)), jnp.ones((16, 4)))
  assert counted.all_to_all == 1, counted
  assert counted.all_reduce == 2, counted   # one psum of two operands: two all-reduces
  assert counted.collective_permute == counted.all_gather == 0, counted
