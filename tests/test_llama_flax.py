"""The linen and NNX SequenceParallelLlamaBlock against the float64 reference
of tests/test_llama.py: their parameter trees are param_layout's (so an
unsharded model's parameters load one-to-one), forward and gradients on 2 and 4
simulated devices, linen under nn.scan, and their argument errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import linen as L
from jax_comm_gemm import nnx as N
from jax_comm_gemm.layers import llama
from test_llama import BATCH, D, F, HEADS, SEQ, assert_matches, random_params, reference


def _data(seed=3):
  kx, kc = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (SEQ, BATCH, D)), jax.random.normal(kc, (SEQ, BATCH, D))


def test_linen_block_matches_float64_with_biases():
  mesh = cpu_mesh(2)
  block = L.SequenceParallelLlamaBlock(HEADS, F, num_kv_heads=2, use_bias=True,
                                       activation=jax.nn.gelu, mesh=mesh)
  x, ct = _data()
  layout = llama.param_layout(D, F, block_options(block), "tp", 2, True)
  abstract = jax.eval_shape(block.init, jax.random.key(0), x)
  assert (jax.tree.structure(nn.unbox(abstract)["params"])
          == jax.tree.structure(jax.tree.map(lambda s: 0, layout)))
  params = random_params(layout, seed=1)
  specs = nn.get_partition_spec(abstract)["params"]
  placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
  x_placed = jax.device_put(x, NamedSharding(mesh, P("tp")))

  def loss(p, x):
    y = block.apply({"params": p}, x)
    return jnp.sum(y * ct), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(placed,
                                                                                 x_placed)
  assert_matches((y, grads), reference(params, x, ct, heads=HEADS, kv_heads=2,
                                       activation=jax.nn.gelu), 2e-5)


def block_options(block):
  return llama.LlamaOptions(block.num_heads, block.num_kv_heads)


class _Layer(nn.Module):
  """A block with nn.scan's (carry, x) -> (carry, y) signature."""
  mesh: object

  @nn.compact
  def __call__(self, x, _):
    return L.SequenceParallelLlamaBlock(HEADS, F, num_kv_heads=1, mesh=self.mesh,
                                        name="block")(x), None


class _Stack(nn.Module):
  mesh: object

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(nn.remat(_Layer), variable_axes={"params": 0}, split_rngs={"params": True},
                   length=2, metadata_params={nn.PARTITION_NAME: None})
    return scan(self.mesh, name="layers")(x, None)[0]


def test_linen_block_under_scan_and_remat_matches_two_blocks():
  """Two (multi-query) blocks under nn.scan of nn.remat, parameters stacked
  along a leading axis."""
  mesh = cpu_mesh(2)
  x, ct = _data(4)
  options = llama.LlamaOptions(HEADS, 1)
  layers = [random_params(llama.param_layout(D, F, options, "tp", 2), seed=s) for s in (5, 6)]
  stacked = jax.tree.map(lambda *a: np.stack(a), *layers)
  got = jax.jit(lambda p, x: _Stack(mesh).apply({"params": {"layers": {"block": p}}}, x))(
      stacked, x)
  want = x
  for p in layers:
    want = reference(p, want, ct, heads=HEADS, kv_heads=1)[0]
  assert float(jnp.linalg.norm(got - want) / np.linalg.norm(want)) < 2e-5


def test_nnx_block_matches_float64_replicated_kv():
  mesh = cpu_mesh(4)
  block = N.SequenceParallelLlamaBlock(D, HEADS, F, num_kv_heads=2, mesh=mesh,
                                       rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(block)
  options = llama.LlamaOptions(HEADS, 2)
  params = random_params(llama.param_layout(D, F, options, "tp", 4), seed=2)
  assert (jax.tree.structure(nnx.to_pure_dict(state))
          == jax.tree.structure(params))
  nnx.replace_by_pure_dict(state, params)
  x, ct = _data(5)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x)
    return jnp.sum(y * ct), y

  (_, y), (g, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
  assert_matches((y, (nnx.to_pure_dict(g), dx)),
                 reference(params, x, ct, heads=HEADS, kv_heads=2), 2e-5)
  assert block.attention.kv.kernel.get_metadata("out_sharding") == (None, None, None)


def test_module_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=8"):
    N.SequenceParallelLlamaBlock(D, HEADS, F, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"head_dim must be even"):
    N.SequenceParallelLlamaBlock(D, HEADS, F, head_dim=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"SequenceParallelLlamaBlock.num_heads=8 is not "
                                       r"divisible by the size 3"):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:3]), ("tp",))
    L.SequenceParallelLlamaBlock(HEADS, F, mesh=mesh).init(jax.random.key(0),
                                                          jnp.ones((6, 1, D)))


def test_nnx_block_keeps_delayed_fp8_histories():
  """Under a "delayed" recipe the NNX block holds one amax history per dense
  layer as OverwriteWithGradient variables; a step replaces them with their
  gradient (the next histories: this step's amaxes in them)."""
  from jax_comm_gemm import CommGemmConfig  # noqa: PLC0415
  from jax_comm_gemm.fp8 import Fp8Recipe  # noqa: PLC0415
  block = N.SequenceParallelLlamaBlock(
      D, HEADS, F, num_kv_heads=2, mesh=cpu_mesh(2), rngs=nnx.Rngs(0),
      config=CommGemmConfig(fp8=Fp8Recipe("delayed", amax_history=4)))
  assert sorted(block.fp8_histories()) == ["fc1", "fc2", "out", "qkv"]
  x, _ = _data(6)
  diff = nnx.DiffState(0, (nnx.Param, N.OverwriteWithGradient))
  _, grads = nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2), argnums=diff)(block, x)
  rest = N.overwrite_with_gradient(block, grads)
  assert "fp8_amax_history" not in nnx.to_pure_dict(rest)
  for name, history in block.fp8_histories().items():
    assert float(history.x[0]) > 0 and float(history.w[0]) > 0, name
