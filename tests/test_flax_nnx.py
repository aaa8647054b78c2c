"""The NNX modules: sharding metadata and placement, both modes against a
float64 reference, dtypes, and configuration errors.

Global mode runs under jax.jit (functional split/merge) on a 1-D ('tp',) mesh
and a ('dp', 'tp') mesh; local mode merges the state, split into shards by its
partition specs, inside the test's own jax.shard_map.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from flax_helpers import (F, K, MESHES, OPTIONS, assert_options_show, dense_ref, features_spec,
                          mlp_ref, tokens_spec, data_axes, dp_tp_mesh)
from flax_helpers import TOKENS as T
from flax import nnx
from fused_emulation import ROUTINGS, standalone_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import nnx as N

# name: (module factory, input width, input spec, output spec, reference)
CASES = {
    "column": (lambda **kw: N.ColumnParallelDense(K, F, **kw), K, tokens_spec,
               features_spec, dense_ref),
    "row": (lambda **kw: N.RowParallelDense(F, K, **kw), F, features_spec,
            tokens_spec, dense_ref),
    "mlp": (lambda **kw: N.SequenceParallelMLP(K, F, **kw), K, tokens_spec,
            tokens_spec, mlp_ref),
}


def x64():
  """float64 on, for the reference (jax.enable_x64 where jax has it)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # noqa: PLC0415  (older jax)
  return enable_x64()


def reference(ref, state, x, ct):
  """(y, d params, dx) of sum(ref(params, x) * ct), in float64."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))
  x, ct = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  with x64():
    y = ref(params, x)
    grads = jax.grad(lambda p, x: jnp.sum(ref(p, x) * ct), argnums=(0, 1))(params, x)
    return jax.tree.map(np.asarray, (y, grads))


def assert_close(got, want, dtype):
  """Tight for float32; for bfloat16, relative to the largest reference value."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  else:
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * scale)


def assert_grads_close(grads, want, dtype):
  got = nnx.to_pure_dict(grads)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32  # gradients in the parameters' dtype
    assert_close(g, r, dtype)


def setup(case, mesh, dtype=None, **kw):
  """(graphdef, state, x, ct, reference, in spec, out spec) of a module built
  on `mesh`, with non-zero biases so that a misplaced bias shows."""
  factory, width, in_spec, out_spec, ref = CASES[case]
  model = factory(mesh=mesh, data_axes=data_axes(mesh), dtype=dtype,
                  bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0), **kw)
  graphdef, state = nnx.split(model)
  kx, kc = jax.random.split(jax.random.key(1))
  x = jax.device_put(jax.random.normal(kx, (T, width)),
                     NamedSharding(mesh, in_spec(mesh)))
  out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
  ct = jax.random.normal(kc, out.shape)
  return graphdef, state, x, ct, ref, in_spec, out_spec


def loss(apply):
  return lambda state, x, ct: jnp.sum(apply(state, x).astype(jnp.float32) * ct)


# --- metadata and placement -----------------------------------------------------

def test_sharding_metadata_and_placement():
  mesh = cpu_mesh(4, "model")
  model = N.SequenceParallelMLP(K, F, axis_name="model", mesh=mesh, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  assert specs == {"fc1": {"kernel": P(None, "model"), "bias": P("model")},
                   "fc2": {"kernel": P("model", None), "bias": P(None)}}
  assert model.fc1.kernel.get_metadata("out_sharding") == (None, "model")
  assert model.fc2.kernel.get_metadata("out_sharding") == ("model", None)
  values = nnx.to_pure_dict(state)
  assert jax.tree.map(jnp.shape, values) == {
      "fc1": {"kernel": (K, F), "bias": (F,)}, "fc2": {"kernel": (F, K), "bias": (K,)}}
  # Placed on the mesh when created, as the metadata says.
  for value, spec in zip(jax.tree.leaves(values),
                         jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P))):
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim)
  assert N.ColumnParallelDense(K, F, mesh=mesh, axis_name="model", use_bias=False,
                               rngs=nnx.Rngs(0)).bias is None


def test_without_a_mesh_params_wait_unplaced_with_metadata():
  model = N.ColumnParallelDense(K, F, rngs=nnx.Rngs(0))
  assert model.kernel.get_metadata("out_sharding") == (None, "tp")
  assert len(model.kernel[...].sharding.device_set) == 1
  mesh = cpu_mesh(4)
  with jax.set_mesh(mesh):  # the mesh may come later, from the context
    x = jax.device_put(jnp.ones((T, K)), NamedSharding(mesh, tokens_spec(mesh)))
    graphdef, state = nnx.split(model)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  np.testing.assert_allclose(y, np.ones((T, K)) @ np.asarray(model.kernel[...]),
                             rtol=1e-5, atol=1e-5)


# --- global mode ----------------------------------------------------------------

@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_global_mode_matches_reference(case, mesh_name):
  mesh = MESHES[mesh_name]()
  graphdef, state, x, ct, ref, _, out_spec = setup(case, mesh)
  apply = lambda s, x: nnx.merge(graphdef, s)(x)
  y = jax.jit(apply)(state, x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec(mesh)), y.ndim)
  grads, dx = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(state, x, ct)
  y_ref, (grads_ref, dx_ref) = reference(ref, state, x, ct)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_grads_close(grads, grads_ref, jnp.float32)


@pytest.mark.parametrize("case", CASES)
def test_global_mode_bfloat16(case):
  mesh = dp_tp_mesh()
  graphdef, state, x, ct, ref, _, _ = setup(case, mesh, dtype=jnp.bfloat16)
  apply = lambda s, x: nnx.merge(graphdef, s)(x)
  y = jax.jit(apply)(state, x)
  assert y.dtype == jnp.bfloat16
  grads, dx = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(state, x, ct)
  y_ref, (grads_ref, dx_ref) = reference(ref, state, x, ct)
  assert_close(y, y_ref, jnp.bfloat16)
  assert_close(dx, dx_ref, jnp.bfloat16)
  assert_grads_close(grads, grads_ref, jnp.bfloat16)


def test_nnx_jit_and_optimizer_step():
  """The stateful NNX style: nnx.jit and nnx.Optimizer over the module."""
  import optax  # noqa: PLC0415

  mesh = dp_tp_mesh()
  model = N.SequenceParallelMLP(K, F, mesh=mesh, data_axes=("dp",), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (T, K)),
                     NamedSharding(mesh, tokens_spec(mesh)))

  @nnx.jit
  def step(model, optimizer, x):
    value, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(x) - x)))(model)
    optimizer.update(model, grads)
    return value

  first = step(model, optimizer, x)
  for _ in range(3):
    last = step(model, optimizer, x)
  assert last < first
  kernel = model.fc1.kernel[...]
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)


# --- local mode -----------------------------------------------------------------

@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_local_mode_inside_shard_map(case, mesh_name):
  mesh = MESHES[mesh_name]()
  graphdef, state, x, ct, ref, in_spec, out_spec = setup(case, mesh)
  specs = nnx.get_partition_spec(state)
  shapes = []

  def body(state, x):
    shapes.append([jnp.shape(a) for a in jax.tree.leaves(state)])
    return nnx.merge(graphdef, state)(x)

  apply = jax.shard_map(body, mesh=mesh, in_specs=(specs, in_spec(mesh)),
                        out_specs=out_spec(mesh))
  y = jax.jit(apply)(state, x)
  grads, dx = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(state, x, ct)
  # The module saw its shards: 'tp' splits the kernels by its size.
  size = mesh.shape["tp"]
  assert shapes[0] == [
      tuple(d // size if name == "tp" else d for d, name in zip(a.shape, spec))
      for a, spec in zip(jax.tree.leaves(state),
                         jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P)))]
  y_ref, (grads_ref, dx_ref) = reference(ref, state, x, ct)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_grads_close(grads, grads_ref, jnp.float32)


# --- the options reach the layers -----------------------------------------------

def _step(case, local, **kw):
  """The jitted gradient of the module with `kw` (global mode, or local mode
  inside the test's shard_map) on a ('tp',) mesh of 2, and its arguments."""
  mesh = cpu_mesh(2)
  graphdef, state, x, ct, _, in_spec, out_spec = setup(case, mesh, **kw)
  apply = lambda s, x: nnx.merge(graphdef, s)(x)  # noqa: E731
  if local:
    apply = jax.shard_map(apply, mesh=mesh,
                          in_specs=(nnx.get_partition_spec(state), in_spec(mesh)),
                          out_specs=out_spec(mesh))
  return jax.jit(jax.grad(loss(apply), argnums=(0, 1))), (state, x, ct)


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("case", CASES)
def test_precision_and_config_reach_every_gemm(case, local):
  """As the linen modules' test of the same name."""
  assert_options_show(*_step(case, local, **OPTIONS))


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("case", ["column", "mlp"])
def test_keep_gathered_input_reaches_the_column_layer(case, local):
  """As the linen modules' test of the same name."""
  config = ROUTINGS["fused_expose"]

  assert [standalone_all_gathers(*_step(case, local, keep_gathered_input=keep, config=config))
          for keep in (False, True)] == [1, 0]


def test_local_mode_bfloat16():
  mesh = dp_tp_mesh()
  graphdef, state, x, ct, ref, in_spec, out_spec = setup("mlp", mesh, dtype=jnp.bfloat16)
  apply = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
                        in_specs=(nnx.get_partition_spec(state), in_spec(mesh)),
                        out_specs=out_spec(mesh))
  y = jax.jit(apply)(state, x)
  assert y.dtype == jnp.bfloat16
  dx = jax.jit(jax.grad(loss(apply), argnums=1))(state, x, ct)
  y_ref, (_, dx_ref) = reference(ref, state, x, ct)
  assert_close(y, y_ref, jnp.bfloat16)
  assert_close(dx, dx_ref, jnp.bfloat16)


def test_dtype_promotion_like_flax_linear():
  mesh = cpu_mesh(2)
  x = jnp.ones((T, K), jnp.bfloat16)
  model = N.ColumnParallelDense(K, F, mesh=mesh, rngs=nnx.Rngs(0))
  assert model(x).dtype == jnp.float32  # dtype=None: from inputs and params
  bf16 = N.ColumnParallelDense(K, F, mesh=mesh, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert bf16(x.astype(jnp.float32)).dtype == jnp.bfloat16
  p16 = N.ColumnParallelDense(K, F, mesh=mesh, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert p16.kernel[...].dtype == jnp.bfloat16


# --- configuration errors -------------------------------------------------------

@pytest.mark.parametrize("build, match", [
    (lambda m: N.ColumnParallelDense(K, 6, mesh=m, rngs=nnx.Rngs(0)),
     r"ColumnParallelDense\.out_features=6 is not divisible by the size 4 .*'tp'"),
    (lambda m: N.RowParallelDense(6, K, mesh=m, rngs=nnx.Rngs(0)),
     r"RowParallelDense\.in_features=6 is not divisible by the size 4"),
    (lambda m: N.SequenceParallelMLP(K, 6, mesh=m, rngs=nnx.Rngs(0)),
     r"SequenceParallelMLP\.hidden_features=6 is not divisible"),
    (lambda m: N.RowParallelDense(F, -1, mesh=m, rngs=nnx.Rngs(0)),
     r"RowParallelDense\.out_features must be a positive int, got -1"),
    (lambda m: N.ColumnParallelDense(K, F, mesh=m, axis_name="model", rngs=nnx.Rngs(0)),
     r"ColumnParallelDense: axis_name='model' is not an axis of the mesh"),
    (lambda m: N.ColumnParallelDense(K, F, mesh=m, data_axes=("tp",), rngs=nnx.Rngs(0)),
     r"ColumnParallelDense: data_axes=\('tp',\) must not contain"),
])
def test_config_errors(build, match):
  with pytest.raises(ValueError, match=match):
    build(cpu_mesh(4))


def test_call_without_any_mesh_says_so():
  model = N.ColumnParallelDense(K, F, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"no mesh"):
    model(jnp.ones((T, K)))


@pytest.mark.parametrize("build, error, match", [
    (lambda m: N.SequenceParallelMLP(K, F, mesh=m, rngs=nnx.Rngs(0)), ValueError,
     r"SequenceParallelMLP: data_axes=\(\) leaves out the mesh axes \('dp',\)"),
    (lambda m: N.ColumnParallelDense(K, F, mesh=m, data_axes="dp", config=None,
                                     rngs=nnx.Rngs(0)),
     TypeError, r"ColumnParallelDense: `config` must be a jax_comm_gemm.CommGemmConfig"),
    (lambda m: N.ColumnParallelDense(K, F, mesh=m, data_axes="dp", keep_gathered_input=0,
                                     rngs=nnx.Rngs(0)),
     TypeError, r"ColumnParallelDense: `keep_gathered_input` must be True or False"),
    (lambda m: N.SequenceParallelMLP(K, F, mesh=m, data_axes="dp", activation=None,
                                     rngs=nnx.Rngs(0)),
     TypeError, r"SequenceParallelMLP: `activation` must be a function"),
    (lambda m: N.RowParallelDense(F, K, mesh=m, data_axes="dp", axis="tp", rngs=nnx.Rngs(0)),
     TypeError, r"RowParallelDense\.__init__\(\) got an unexpected keyword argument 'axis'"),
], ids=["missing_data_axis", "config", "keep", "activation", "unknown"])
def test_arguments_are_checked_and_named(build, error, match):
  with pytest.raises(error, match=match):
    build(dp_tp_mesh())


def test_zero_tokens_are_named():
  model = N.ColumnParallelDense(K, F, mesh=cpu_mesh(2), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"ColumnParallelDense: `inputs` has shape \(0, 16\), "
                                       r"with a dimension of size 0"):
    model(jnp.zeros((0, K)))
