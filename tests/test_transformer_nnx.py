"""The NNX transformer block against the same plain-Flax float64 reference as
the linen block (tests/test_transformer.py): global mode under jax.jit, local
mode inside the test's shard_map, ``nnx.remat``, ``nnx.scan`` over layers and
the stateful ``nnx.jit`` + ``nnx.Optimizer`` style."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from flax import nnx
from flax_helpers import OPTIONS, assert_options_show, dp_tp_mesh
from fused_emulation import ROUTINGS, standalone_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_transformer import (BATCH, D, F, HEADS, MESHES, SEQ, assert_all_close, data_axes,
                              random_params, reference, tokens_spec)

from jax_comm_gemm import nnx as N


def build(mesh=None, layers=None, **kw):
  kw.setdefault("data_axes", data_axes(mesh) if mesh is not None else ())

  def create(rngs):
    return N.SequenceParallelTransformerBlock(D, HEADS, F, mesh=mesh, rngs=rngs, **kw)

  if layers is None:
    return create(nnx.Rngs(0))
  stacked = nnx.vmap(create, in_axes=(0,), out_axes=0,
                     transform_metadata={nnx.PARTITION_NAME: None})
  return nnx.split_rngs(splits=layers)(stacked)(nnx.Rngs(0))


def setup(model, mesh):
  """(graphdef, state, x, ct, specs): the state with random values (biases and
  LayerNorm parameters away from their initial values), placed by its specs."""
  graphdef, state = nnx.split(model)
  specs = nnx.get_partition_spec(state)
  values = random_params(nnx.to_pure_dict(state))
  placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), values,
                        nnx.to_pure_dict(specs))
  nnx.replace_by_pure_dict(state, placed)
  kx, kc = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(kx, (SEQ, BATCH, D)),
                     NamedSharding(mesh, tokens_spec(mesh)))
  return graphdef, state, x, jax.random.normal(kc, (SEQ, BATCH, D)), specs


def run(apply, state, x, ct):
  def loss(s, x):
    y = apply(s, x)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), (dstate, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      state, x)
  return y, (nnx.to_pure_dict(dstate), dx)


@pytest.mark.parametrize("mesh_name, routing", [
    ("tp2", "xla"), ("tp4", "fused_expose"), ("tp8", "xla"), ("dp2xtp4", "fused_hidden")])
def test_global_mode_matches_reference(mesh_name, routing):
  mesh = MESHES[mesh_name]()
  graphdef, state, x, ct, _ = setup(build(mesh, config=ROUTINGS[routing]), mesh)
  y, grads = run(lambda s, x: nnx.merge(graphdef, s)(x), state, x, ct)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, tokens_spec(mesh)), 3)
  assert_all_close(y, grads, reference(nnx.to_pure_dict(state), x, ct), jnp.float32)


def test_block_options_reach_the_block():
  """Not causal, another activation and an epsilon that matters, as the
  linen block's test_block_options_reach_the_block."""
  mesh = cpu_mesh(2)
  options = dict(causal=False, activation=jax.nn.relu, epsilon=0.5)
  graphdef, state, x, ct, _ = setup(build(mesh, config=ROUTINGS["fused_expose"], **options),
                                    mesh)
  y, grads = run(lambda s, x: nnx.merge(graphdef, s)(x), state, x, ct)
  assert_all_close(y, grads, reference(nnx.to_pure_dict(state), x, ct, **options),
                   jnp.float32)


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
def test_module_options_reach_the_block():
  """As the linen block's test of the same name."""
  mesh = cpu_mesh(2)

  def step(**kw):
    graphdef, state, x, ct, _ = setup(build(mesh, **kw), mesh)
    grad = jax.grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) * ct), argnums=(0, 1))
    return jax.jit(grad), (state, x)

  assert_options_show(*step(**OPTIONS), every_dot=False)
  fused = ROUTINGS["fused_expose"]
  assert standalone_all_gathers(*step(config=fused)) == 2
  assert standalone_all_gathers(*step(config=fused, keep_gathered_input=True)) == 0


def test_bfloat16_under_nnx_remat():
  mesh = dp_tp_mesh()
  model = build(mesh, dtype=jnp.bfloat16, keep_gathered_input=True,
                config=ROUTINGS["fused_expose"])
  graphdef, state, x, ct, _ = setup(model, mesh)

  def apply(s, x):
    return nnx.remat(lambda block, x: block(x))(nnx.merge(graphdef, s), x)

  y, grads = run(apply, state, x, ct)
  assert y.dtype == jnp.bfloat16
  assert_all_close(y, grads, reference(nnx.to_pure_dict(state), x, ct), jnp.bfloat16)


def test_local_mode_inside_shard_map():
  mesh = dp_tp_mesh()
  graphdef, state, x, ct, specs = setup(build(mesh, config=ROUTINGS["fused_expose"]), mesh)
  apply = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
                        in_specs=(specs, tokens_spec(mesh)), out_specs=tokens_spec(mesh))
  y, grads = run(apply, state, x, ct)
  assert_all_close(y, grads, reference(nnx.to_pure_dict(state), x, ct), jnp.float32)


def test_scan_over_remat_layers():
  mesh = dp_tp_mesh()
  graphdef, state, x, ct, specs = setup(build(mesh, layers=3), mesh)
  assert nnx.to_pure_dict(specs)["attention"]["qkv"]["kernel"] == P(None, None, "tp")

  def apply(s, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)

    return body(x, nnx.merge(graphdef, s))

  y, grads = run(apply, state, x, ct)
  assert_all_close(y, grads, reference(nnx.to_pure_dict(state), x, ct, layers=3),
                   jnp.float32)


def test_nnx_jit_and_optimizer_step():
  import optax  # noqa: PLC0415

  mesh = dp_tp_mesh()
  model = build(mesh, config=ROUTINGS["fused_expose"])
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (SEQ, BATCH, D)),
                     NamedSharding(mesh, tokens_spec(mesh)))

  @nnx.jit
  def step(model, optimizer, x):
    loss = lambda m: jnp.mean(jnp.square(m(x) - jnp.roll(x, 1, axis=0)))
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  first = step(model, optimizer, x)
  for _ in range(4):
    last = step(model, optimizer, x)
  assert last < first
  assert model.attention.qkv.kernel[...].sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, "tp")), 2)


def test_state_names_and_metadata():
  model = build(cpu_mesh(4))
  assert jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(model))) == {
      "ln_1": {"scale": (D,), "bias": (D,)}, "ln_2": {"scale": (D,), "bias": (D,)},
      "attention": {"qkv": {"kernel": (D, 3 * D), "bias": (3 * D,)},
                    "out": {"kernel": (D, D), "bias": (D,)}},
      "mlp": {"fc1": {"kernel": (D, F), "bias": (F,)}, "fc2": {"kernel": (F, D), "bias": (D,)}}}
  assert model.ln_1.scale.get_metadata("out_sharding") == (None,)
  assert model.attention.out.kernel.get_metadata("out_sharding") == ("tp", None)


@pytest.mark.parametrize("kw, match", [
    (dict(num_heads=6), r"SequenceParallelTransformerBlock\.num_heads=6 is not divisible "
                        r"by the size 4"),
    (dict(hidden_features=34), r"SequenceParallelTransformerBlock\.hidden_features=34 is "
                               r"not divisible"),
    (dict(in_features=36), r"SequenceParallelTransformerBlock\.in_features=36 must divide "
                           r"into num_heads=8"),
])
def test_config_errors(kw, match):
  args = dict(in_features=D, num_heads=HEADS, hidden_features=F) | kw
  with pytest.raises(ValueError, match=match):
    N.SequenceParallelTransformerBlock(**args, mesh=cpu_mesh(4), rngs=nnx.Rngs(0))


def test_input_errors_name_the_module():
  model = build(cpu_mesh(4))
  with pytest.raises(ValueError, match=r"SequenceParallelTransformerBlock: `inputs` has 2 "
                                       r"positions .*jnp\.swapaxes"):
    model(jnp.zeros((BATCH, SEQ, D)))
