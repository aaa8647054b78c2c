"""All-gathers per transformer block, forward + backward, for each routing: the
README's table, counted in the compiled program.

As in tests/test_routing_hlo.py, :class:`~fused_emulation.EmulatedFusedBackend`
stands in for the opaque cuBLASMp custom calls: collectives inside its
``fused_emulation`` scope are the fused ops' own, every other all-gather is a
standalone ``lax.all_gather``. A block holds two column-parallel layers (QKV,
fc1) and two row-parallel ones (out-proj, fc2), so each count is twice the SP
MLP block's:

* fused AllGather+GEMMs: QKV's and fc1's forward, out-proj's and fc2's dgrad (4);
* standalone all-gathers: out-proj's and fc2's weight gradients gather dy
  unless they reuse what their dgrad op gathered; QKV's and fc1's gather their
  input again unless the forward's gathered input is kept and handed out.
"""

import jax
import jax.numpy as jnp
import pytest

from conftest import cpu_mesh
from fused_emulation import SCOPE, EmulatedFusedBackend, random_inputs
from jax_comm_gemm import CommGemmConfig, hlo
from jax_comm_gemm.layers import transformer

SEQ, BATCH, D, HEADS, F = 16, 2, 16, 4, 32

XLA = CommGemmConfig(backend="xla")
REUSE = CommGemmConfig(backend=EmulatedFusedBackend(expose=True))
HIDDEN = CommGemmConfig(backend=EmulatedFusedBackend(expose=False))
NO_REUSE = CommGemmConfig(backend=EmulatedFusedBackend(expose=True), reuse_gathered=False)

# routing: (config, keep_gathered_input, standalone all-gathers, fused AllGather+GEMMs)
TABLE = {
    "xla_fallback": (XLA, False, 4, 0),
    "xla_fallback_keep": (XLA, True, 4, 0),
    "fused_without_reuse": (NO_REUSE, False, 4, 4),
    "fused_not_exposed": (HIDDEN, False, 4, 4),
    "fused_without_reuse_keep": (NO_REUSE, True, 4, 4),
    "fused_with_reuse": (REUSE, False, 2, 4),
    "fused_with_reuse_keep": (REUSE, True, 0, 4),
}


def block_counts(config, keep, remat=False):
  """(all collectives, those inside the fused ops) of a block's jitted
  value_and_grad on 2 devices."""
  mesh = cpu_mesh(2)
  layout = transformer.param_layout(D, F, "tp")
  leaves, tree = jax.tree.flatten(layout)
  x, *values = random_inputs(7, [(SEQ, BATCH, D)] + [s.shape for s in leaves], jnp.float32)
  params = jax.tree.unflatten(tree, values)
  options = transformer.BlockOptions(num_heads=HEADS, keep_gathered_input=keep,
                                     config=config)

  def apply(params, x):
    return transformer.sharded_transformer_block(x, params, mesh=mesh, options=options)

  if remat:
    apply = jax.checkpoint(apply)
  loss = lambda params, x: jnp.sum(apply(params, x) ** 2)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
  return hlo.count_collectives(text), hlo.count_collectives(text, SCOPE)


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("routing", TABLE)
def test_all_gathers_per_block(routing):
  config, keep, standalone, fused = TABLE[routing]
  total, inside = block_counts(config, keep)
  assert inside.all_gather == fused
  assert total.all_gather - inside.all_gather == standalone
  # Reduce-scatters: out-proj's and fc2's forward, QKV's and fc1's dgrad.
  assert total.reduce_scatter == 4
  assert inside.reduce_scatter == (4 if fused else 0)


@pytest.mark.parametrize("routing, standalone, fused", [
    ("xla_fallback", 6, 0), ("fused_with_reuse", 2, 6), ("fused_with_reuse_keep", 0, 6)])
def test_remat_recomputes_the_forward_gathers(routing, standalone, fused):
  """Under jax.checkpoint the backward pass reruns QKV's and fc1's forward
  AllGather+GEMM (2 more, fused or not); the weight gradients' routing is
  unchanged."""
  config, keep, _, _ = TABLE[routing]
  total, inside = block_counts(config, keep, remat=True)
  assert inside.all_gather == fused
  assert total.all_gather - inside.all_gather == standalone
