"""The routing of the gathered operand, as it shows in the compiled program.

With :class:`~fused_emulation.EmulatedFusedBackend` standing in for the opaque
cuBLASMp custom calls, the collectives inside the "fused ops" carry the
``fused_emulation`` scope; every all-gather outside it is a standalone
``lax.all_gather`` that the routing emitted. Counted in the compiled
``jax.jit(jax.value_and_grad(loss))`` of a whole forward+backward pass, the
standalone all-gathers follow the reuse of the gathered operand
(docs/design.md, "The gathered operand and its layout") as
``diagnostics.report.expected_all_gathers`` counts them.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from fused_emulation import SCOPE, EmulatedFusedBackend, random_inputs
from jax_comm_gemm import CommGemmConfig, all_gather_matmul, hlo, sharded
from jax_comm_gemm.backends import XlaBackend

N, K, F = 16, 8, 16  # tokens, hidden, MLP features

REUSE = CommGemmConfig(backend=EmulatedFusedBackend(expose=True))
HIDDEN = CommGemmConfig(backend=EmulatedFusedBackend(expose=False))
NO_REUSE = CommGemmConfig(backend=EmulatedFusedBackend(expose=True), reuse_gathered=False)


def _counts(fn, *args):
  """(all collectives, those inside the fused ops, the HLO's collective lines)."""
  text = fn.lower(*args).compile().as_text()
  lines = "\n".join(line.strip()[:240] for line in text.splitlines()
                    if "all-gather" in line or "reduce-scatter" in line)
  return hlo.count_collectives(text), hlo.count_collectives(text, SCOPE), lines


def _row_parallel_counts(config):
  mesh = cpu_mesh(2)
  h, kernel = random_inputs(1, [(N, F), (F, K)], jnp.float32)

  def loss(h, kernel):
    return jnp.sum(sharded.row_parallel_dense(h, kernel, mesh=mesh, config=config) ** 2)

  return _counts(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), h, kernel)


def _mlp_counts(config, keep_gathered_input):
  mesh = cpu_mesh(2)
  x, fc1, fc2 = random_inputs(2, [(N, K), (K, F), (F, K)], jnp.float32)

  def loss(x, fc1, fc2):
    y = sharded.mlp(x, fc1, fc2, mesh=mesh, keep_gathered_input=keep_gathered_input,
                    config=config)
    return jnp.sum(y ** 2)

  return _counts(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), x, fc1, fc2)


def test_emulated_fused_op_is_opaque_to_cse():
  """The premise: XLA merges a standalone all-gather with the one inside
  XlaBackend's op, but not with the one inside the emulated fused op."""
  mesh = cpu_mesh(2)
  x, w = random_inputs(3, [(N, K), (K, F)], jnp.float32)

  def program(config):
    def local(x, w):
      y = all_gather_matmul(x, w, "tp", config=config)
      return y, lax.all_gather(x, "tp", axis=0, tiled=True)[None]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=(P(None, "tp"), P("tp"))))

  total, _, lines = _counts(program(CommGemmConfig(backend=XlaBackend())), x, w)
  assert total.all_gather == 1, lines
  total, fused, lines = _counts(program(REUSE), x, w)
  assert (total.all_gather, fused.all_gather) == (2, 1), lines


@pytest.mark.parametrize("config, standalone", [
    (REUSE, 0),      # dgrad's fused AG+GEMM hands its gathered dy to wgrad
    (HIDDEN, 1),     # the capability check fails: wgrad all-gathers dy again
    (NO_REUSE, 1),   # reuse_gathered=False: the same, by choice
], ids=["reuse", "not_exposed", "reuse_gathered_false"])
def test_row_parallel_all_gathers(config, standalone):
  """Row-parallel layer, forward+backward: 1 fused AllGather+GEMM (dgrad) and
  0 standalone all-gathers with reuse, 1 without; its forward is the one fused
  GEMM+ReduceScatter."""
  total, fused, lines = _row_parallel_counts(config)
  assert fused.all_gather == 1, lines
  assert total.all_gather - fused.all_gather == standalone, lines
  assert (total.reduce_scatter, fused.reduce_scatter) == (1, 1), lines


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("config, keep, standalone", [
    # fc1's wgrad re-gathers its input; fc2's wgrad reuses the gathered dy.
    (REUSE, False, 1),
    # fc1's forward fused op hands out its gathered input too.
    (REUSE, True, 0),
    # fc1's wgrad re-gathers its input and fc2's wgrad all-gathers dy.
    (HIDDEN, False, 2),
    (NO_REUSE, False, 2),
    # Keeping fc1's input without reuse moves fc1's all-gather to the forward
    # (the fused op cannot hand out its gathered input); fc2's wgrad still
    # all-gathers dy: 2, not fewer.
    (HIDDEN, True, 2),
    (NO_REUSE, True, 2),
], ids=["reuse", "reuse_keep", "not_exposed", "reuse_gathered_false",
        "not_exposed_keep", "reuse_gathered_false_keep"])
def test_mlp_all_gathers(config, keep, standalone):
  """MLP block, forward+backward: 2 fused AllGather+GEMMs (fc1 forward, fc2
  dgrad), 2 fused GEMM+ReduceScatters (fc2 forward, fc1 dgrad) and the
  standalone all-gathers that ``diagnostics.report.expected_all_gathers``
  expects (docs/design.md, "The gathered operand and its layout")."""
  total, fused, lines = _mlp_counts(config, keep)
  assert fused.all_gather == 2, lines
  assert total.all_gather - fused.all_gather == standalone, lines
  assert (total.reduce_scatter, fused.reduce_scatter) == (2, 2), lines


def _pure_jax_mlp_all_gathers() -> int:
  """All-gathers in autodiff of the plain shard_map(all_gather -> dot) MLP."""
  mesh = cpu_mesh(2)
  x, fc1, fc2 = random_inputs(2, [(N, K), (K, F), (F, K)], jnp.float32)

  def local(x, fc1, fc2):
    h = jax.nn.gelu(lax.all_gather(x, "tp", axis=0, tiled=True) @ fc1)
    return lax.psum_scatter(h @ fc2, "tp", scatter_dimension=0, tiled=True)

  def loss(x, fc1, fc2):
    mlp = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                        out_specs=P("tp"))
    return jnp.sum(mlp(x, fc1, fc2) ** 2)

  total, _, _ = _counts(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), x, fc1, fc2)
  return total.all_gather


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep"])
def test_xla_backend_mlp_matches_pure_jax_all_gather_count(keep):
  """With XLA's own collectives, the MLP forward+backward has no more than the
  2 all-gathers of autodiff of plain shard_map(all_gather -> dot)."""
  pure = _pure_jax_mlp_all_gathers()
  assert pure == 2  # as diagnostics.report.expected_all_gathers says for XLA's path
  total, fused, lines = _mlp_counts(CommGemmConfig(backend="xla"), keep)
  assert fused.all_gather == 0, lines
  assert total.all_gather <= pure, lines
