"""The FP8 MLP the collective tests share (test_fp8_ring.py, test_fp8_fused.py):
fresh inputs, and loss + gradients of fc1 (all-gather) then fc2
(reduce-scatter) on given collectives."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_comm_gemm.fp8 import fp8_all_gather_matmul, fp8_matmul_reduce_scatter

N, D, F = 64, 48, 32  # tokens, model width, hidden width (global)


def inputs(seed=0):
  """x [N, D], w1 [D, F], w2 [F, D], f32."""
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (N, D)),
          jax.random.normal(keys[1], (D, F)) / np.sqrt(D),
          jax.random.normal(keys[2], (F, D)) / np.sqrt(F))


def step(mesh, recipe, collectives, keep=False):
  """jit of (x, w1, w2) -> (loss, grads) of the FP8 MLP over axis "tp"."""
  def mlp(x, w1, w2):
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, collectives=collectives,
                              keep_gathered_input=keep)
    return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe,
                                     collectives=collectives)
  f = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                    out_specs=P("tp"))
  weights = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * weights), argnums=(0, 1, 2)))
