"""Delayed FP8 scaling through the MLP helpers (``dense.mlp`` on local shards,
``sharded.mlp`` on global arrays), on CPU: with the histories of
``init_mlp_fp8_histories`` they compute what the FP8 ops compute with the same
histories, loss and gradients, the histories' gradient (the next histories)
included."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh
from jax_comm_gemm import dense, sharded
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from tolerance import assert_fp8_programs_close

N, D, F = 64, 48, 32
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
CONFIG = jcg.CommGemmConfig(fp8=Fp8Recipe("delayed", amax_history=4))
WEIGHTS = jnp.cos(jnp.arange(D, dtype=jnp.float32))


def _inputs():
  keys = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(keys[0], (N, D)).at[:N // 2].multiply(50.0)  # rank 0's rows larger
  return (x, jax.random.normal(keys[1], (D, F)) / np.sqrt(D),
          jax.random.normal(keys[2], (F, D)) / np.sqrt(F))


def _grads(f):
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * WEIGHTS), argnums=(0, 1, 2, 3)))


def test_the_mlp_helpers_carry_their_histories_as_the_ops_do():
  mesh = cpu_mesh(2)
  x, w1, w2 = _inputs()
  recipe = CONFIG.fp8
  # Non-empty histories, as after a few steps.
  hs = {name: jax.tree.map(lambda z, i=i: z.at[1].set(200.0 + i), h)
        for i, (name, h) in enumerate(sharded.init_mlp_fp8_histories(CONFIG).items())}

  def ops(x, w1, w2, hs):
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=hs["fc1"])
    return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe,
                                     history=hs["fc2"])
  specs = (P("tp"), P(None, "tp"), P("tp"), P())
  want = _grads(jax.shard_map(ops, mesh=mesh, in_specs=specs, out_specs=P("tp")))(
      x, w1, w2, hs)
  local = jax.shard_map(lambda x, w1, w2, hs: dense.mlp(x, w1, w2, axis_name="tp",
                                                        config=CONFIG, fp8_histories=hs),
                        mesh=mesh, in_specs=specs, out_specs=P("tp"))
  on_global = lambda x, w1, w2, hs: sharded.mlp(x, w1, w2, mesh=mesh, config=CONFIG,
                                                fp8_histories=hs)
  # Three programs of the same FP8 arithmetic: GELU's input may round otherwise
  # in each, so a code may flip, E4M3 in the loss, E5M2 in what the gradients
  # reach (tests/tolerance.py); the reductions: fc1's and fc2's GEMMs both ways
  # and the weight gradients' over the tokens.
  k = 2 * (D + F) + N
  for got in (_grads(local)(x, w1, w2, hs), _grads(on_global)(x, w1, w2, hs)):
    (loss, grads), (loss_want, grads_want) = got, want
    assert_fp8_programs_close(loss, loss_want, fmt=E4, k=k + N * D, what="loss")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_want)):
      assert_fp8_programs_close(g, w, fmt=E5, k=k, what=jax.tree_util.keystr(path))
  # The next histories: this step's amax of the whole x in front of fc1's.
  next_x = got[1][3]["fc1"].x
  # Exact: a maximum of the input, and a shifted history entry.
  assert float(next_x[0]) == float(jnp.max(jnp.abs(x))) and float(next_x[2]) == 200.0
