"""The linen modules: partitioning metadata, both modes against a float64
reference, dtypes, and configuration errors.

Global mode runs under jax.jit with NamedSharding on a 1-D ('tp',) mesh and a
('dp', 'tp') mesh; local mode runs the same parameters, split by their
partition specs, inside the test's own jax.shard_map.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from flax_helpers import (F, K, MESHES, OPTIONS, assert_options_show, dense_ref, features_spec,
                          mlp_ref, tokens_spec, data_axes, dp_tp_mesh)
from flax_helpers import TOKENS as N
from fused_emulation import ROUTINGS, standalone_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import linen as L
from jax_comm_gemm.flax.common import DEFAULTS

# name: (module factory, input width, input spec, output spec, reference)
CASES = {
    "column": (lambda **kw: L.ColumnParallelDense(F, **kw), K, tokens_spec,
               features_spec, dense_ref),
    "row": (lambda **kw: L.RowParallelDense(K, **kw), F, features_spec,
            tokens_spec, dense_ref),
    "mlp": (lambda **kw: L.SequenceParallelMLP(F, **kw), K, tokens_spec,
            tokens_spec, mlp_ref),
}


def x64():
  """float64 on, for the reference (jax.enable_x64 where jax has it)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # noqa: PLC0415  (older jax)
  return enable_x64()


def reference(ref, params, x, ct):
  """(y, d params, dx) of sum(ref(params, x) * ct), in float64."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params)["params"])
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


def setup(case, mesh, dtype=None, x_shape=None, **kw):
  """The global-mode module, sharded params, sharded x and a cotangent."""
  factory, width, in_spec, out_spec, ref = CASES[case]
  model = factory(mesh=mesh, data_axes=data_axes(mesh), dtype=dtype, **kw)
  x_shape = x_shape or (N, width)
  kx, kc, kp = jax.random.split(jax.random.key(0), 3)
  x = jax.device_put(jax.random.normal(kx, x_shape),
                     NamedSharding(mesh, in_spec(mesh, len(x_shape))))
  shardings = nn.get_sharding(jax.eval_shape(model.init, kp, x), mesh)
  # Non-zero biases, so that a misplaced bias shows.
  model_init = factory(mesh=mesh, data_axes=data_axes(mesh), dtype=dtype,
                       bias_init=nn.initializers.normal(1.0), **kw)
  params = jax.jit(model_init.init, out_shardings=shardings)(kp, x)
  out_shape = jax.eval_shape(model.apply, params, x).shape
  ct = jax.random.normal(kc, out_shape)
  return model, params, x, ct, ref, in_spec, out_spec


def loss(apply):
  return lambda params, x, ct: jnp.sum(apply(params, x).astype(jnp.float32) * ct)


# --- metadata -------------------------------------------------------------------

def test_partition_specs():
  x = jnp.zeros((N, K))
  key = jax.random.key(0)
  mesh = cpu_mesh(4)
  specs = lambda m: nn.get_partition_spec(jax.eval_shape(m.init, key, x))["params"]
  assert specs(L.ColumnParallelDense(F, mesh=mesh)) == {
      "kernel": P(None, "tp"), "bias": P("tp")}
  assert specs(L.RowParallelDense(K, mesh=mesh)) == {
      "kernel": P("tp", None), "bias": P(None)}
  assert specs(L.SequenceParallelMLP(F, axis_name="model", mesh=cpu_mesh(4, "model"))) == {
      "fc1": {"kernel": P(None, "model"), "bias": P("model")},
      "fc2": {"kernel": P("model", None), "bias": P(None)}}
  shapes = jax.eval_shape(L.SequenceParallelMLP(F, mesh=mesh).init, key, x)
  assert jax.tree.map(jnp.shape, nn.unbox(shapes))["params"] == {
      "fc1": {"kernel": (K, F), "bias": (F,)}, "fc2": {"kernel": (F, K), "bias": (K,)}}
  assert "bias" not in specs(L.ColumnParallelDense(F, mesh=mesh, use_bias=False))


# --- global mode ----------------------------------------------------------------

@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_global_mode_matches_reference(case, mesh_name):
  mesh = MESHES[mesh_name]()
  model, params, x, ct, ref, _, out_spec = setup(case, mesh)
  y = jax.jit(model.apply)(params, x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec(mesh)), y.ndim)
  (dparams, dx) = jax.jit(jax.grad(loss(model.apply), argnums=(0, 1)))(params, x, ct)
  y_ref, (dparams_ref, dx_ref) = reference(ref, params, x, ct)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  jax.tree.map(lambda g, r: assert_close(g, r, jnp.float32),
               nn.unbox(dparams)["params"], dparams_ref)


@pytest.mark.parametrize("case", CASES)
def test_global_mode_bfloat16(case):
  mesh = dp_tp_mesh()
  model, params, x, ct, ref, _, _ = setup(case, mesh, dtype=jnp.bfloat16)
  y = jax.jit(model.apply)(params, x)
  assert y.dtype == jnp.bfloat16
  (dparams, dx) = jax.jit(jax.grad(loss(model.apply), argnums=(0, 1)))(params, x, ct)
  y_ref, (dparams_ref, dx_ref) = reference(ref, params, x, ct)
  assert_close(y, y_ref, jnp.bfloat16)
  assert_close(dx, dx_ref, jnp.bfloat16)
  for g, r in zip(jax.tree.leaves(nn.unbox(dparams)), jax.tree.leaves(dparams_ref)):
    assert g.dtype == jnp.float32  # gradients in the parameters' dtype
    assert_close(g, r, jnp.bfloat16)


def test_global_mode_takes_the_mesh_from_set_mesh():
  mesh = cpu_mesh(4)
  model, params, x, _, ref, _, _ = setup("mlp", mesh)
  unset = L.SequenceParallelMLP(F)  # mesh=None
  with jax.set_mesh(mesh):
    y = jax.jit(unset.apply)(params, x)
  assert_close(y, jax.jit(model.apply)(params, x), jnp.float32)


def test_leading_dimensions_and_no_bias():
  mesh = dp_tp_mesh()
  model, params, x, _, _, _, _ = setup("column", mesh, x_shape=(8, 3, K), use_bias=False)
  kernel = np.asarray(nn.unbox(params)["params"]["kernel"])
  y = jax.jit(model.apply)(params, x)
  assert y.shape == (8, 3, F)
  np.testing.assert_allclose(y, np.asarray(x) @ kernel, rtol=1e-5, atol=1e-5)


def test_dtype_promotion_like_flax_dense():
  mesh = cpu_mesh(2)
  model = L.ColumnParallelDense(F, mesh=mesh)  # dtype=None: from inputs and params
  x = jnp.ones((N, K), jnp.bfloat16)
  params = model.init(jax.random.key(0), x)
  assert jax.jit(model.apply)(params, x).dtype == jnp.float32
  bf16 = L.ColumnParallelDense(F, mesh=mesh, dtype=jnp.bfloat16)
  assert jax.jit(bf16.apply)(params, x.astype(jnp.float32)).dtype == jnp.bfloat16
  p16 = L.ColumnParallelDense(F, mesh=mesh, param_dtype=jnp.bfloat16).init(
      jax.random.key(0), x)
  assert nn.unbox(p16)["params"]["kernel"].dtype == jnp.bfloat16


# --- local mode -----------------------------------------------------------------

@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("case", CASES)
def test_local_mode_inside_shard_map(case, mesh_name):
  mesh = MESHES[mesh_name]()
  model, params, x, ct, ref, in_spec, out_spec = setup(case, mesh)
  local_model = CASES[case][0]()  # no mesh: it is the caller's shard_map's
  specs = nn.get_partition_spec(params)
  shapes = []

  def body(params, x):
    shapes.append([jnp.shape(a) for a in jax.tree.leaves(params)])
    return local_model.apply(params, x)

  apply = jax.shard_map(body, mesh=mesh, in_specs=(specs, in_spec(mesh)),
                        out_specs=out_spec(mesh))
  y = jax.jit(apply)(params, x)
  (dparams, dx) = jax.jit(jax.grad(loss(apply), argnums=(0, 1)))(params, x, ct)
  # Local mode saw the shards: 'tp' splits the kernels by its size.
  size = mesh.shape["tp"]
  assert shapes[0] == [
      tuple(d // size if name == "tp" else d for d, name in zip(a.shape, spec))
      for a, spec in zip(jax.tree.leaves(params),
                         jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P)))]
  y_ref, (dparams_ref, dx_ref) = reference(ref, params, x, ct)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  jax.tree.map(lambda g, r: assert_close(g, r, jnp.float32),
               nn.unbox(dparams)["params"], dparams_ref)


# --- the options reach the layers -----------------------------------------------

def _step(case, local, **kw):
  """The jitted gradient of the module with `kw` (global mode, or local mode
  inside the test's shard_map) on a ('tp',) mesh of 2, and its arguments."""
  mesh = cpu_mesh(2)
  model, params, x, ct, _, in_spec, out_spec = setup(case, mesh, **kw)
  apply = model.apply
  if local:
    apply = jax.shard_map(CASES[case][0](**kw).apply, mesh=mesh,
                          in_specs=(nn.get_partition_spec(params), in_spec(mesh)),
                          out_specs=out_spec(mesh))
  return jax.jit(jax.grad(loss(apply), argnums=(0, 1))), (params, x, ct)


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("case", CASES)
def test_precision_and_config_reach_every_gemm(case, local):
  """Forward and backward: every dot at the module's precision, and both ops
  on the configured backend (the ring's ppermutes), in both modes."""
  assert_options_show(*_step(case, local, **OPTIONS))


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("case", ["column", "mlp"])
def test_keep_gathered_input_reaches_the_column_layer(case, local):
  """With the fused op handing out its gathered operand, keeping the input
  leaves the backward pass no all-gather of its own (README's table)."""
  config = ROUTINGS["fused_expose"]

  assert [standalone_all_gathers(*_step(case, local, keep_gathered_input=keep, config=config))
          for keep in (False, True)] == [1, 0]


def test_local_mode_bfloat16():
  mesh = dp_tp_mesh()
  model, params, x, ct, ref, in_spec, out_spec = setup("mlp", mesh, dtype=jnp.bfloat16)
  apply = jax.shard_map(L.SequenceParallelMLP(F, dtype=jnp.bfloat16).apply, mesh=mesh,
                        in_specs=(nn.get_partition_spec(params), in_spec(mesh)),
                        out_specs=out_spec(mesh))
  y = jax.jit(apply)(params, x)
  assert y.dtype == jnp.bfloat16
  dx = jax.jit(jax.grad(loss(apply), argnums=1))(params, x, ct)
  y_ref, (_, dx_ref) = reference(ref, params, x, ct)
  assert_close(y, y_ref, jnp.bfloat16)
  assert_close(dx, dx_ref, jnp.bfloat16)


# --- configuration errors -------------------------------------------------------

@pytest.mark.parametrize("module, x_width, match", [
    (lambda m: L.ColumnParallelDense(6, mesh=m), K,
     r"ColumnParallelDense\.features=6 is not divisible by the size 4 .*'tp'"),
    (lambda m: L.RowParallelDense(K, mesh=m), 6,
     r"RowParallelDense: the input features, inputs\.shape\[-1\]=6 is not divisible"),
    (lambda m: L.SequenceParallelMLP(6, mesh=m), K,
     r"SequenceParallelMLP\.hidden_features=6 is not divisible"),
    (lambda m: L.SequenceParallelMLP(0, mesh=m), K,
     r"SequenceParallelMLP\.hidden_features must be a positive int, got 0"),
    (lambda m: L.ColumnParallelDense(F, mesh=m, axis_name="model"), K,
     r"ColumnParallelDense: axis_name='model' is not an axis of the mesh"),
    (lambda m: L.ColumnParallelDense(F, mesh=m, data_axes=("tp",)), K,
     r"ColumnParallelDense: data_axes=\('tp',\) must not contain"),
    (lambda m: L.RowParallelDense(K, mesh=m, data_axes=("dp",)), F,
     r"RowParallelDense: data_axes=\('dp',\) names 'dp', which is not an axis of the mesh"),
    (lambda m: L.ColumnParallelDense(F), K, r"no mesh"),
])
def test_config_errors(module, x_width, match):
  with pytest.raises(ValueError, match=match):
    module(cpu_mesh(4)).init(jax.random.key(0), jnp.zeros((N, x_width)))


def test_global_tokens_that_do_not_split_over_the_shards():
  """On global arrays the module checks the tokens itself, before shard_map
  would fail with its own words."""
  with pytest.raises(ValueError, match=r"ColumnParallelDense: `inputs` has 6 tokens \(first "
                                       r"dimension\), which is not divisible by the size 4"):
    L.ColumnParallelDense(F, mesh=cpu_mesh(4)).init(jax.random.key(0), jnp.zeros((6, K)))


def test_odd_features_on_two_shards():
  """TP 2, the size most runs use, checks like any other."""
  with pytest.raises(ValueError, match=r"ColumnParallelDense\.features=7 is not divisible by "
                                       r"the size 2 "):
    L.ColumnParallelDense(7, mesh=cpu_mesh(2)).init(jax.random.key(0), jnp.zeros((N, K)))


@pytest.mark.parametrize("module, x_shape, error, match", [
    (lambda m: L.SequenceParallelMLP(F, mesh=m), (N, K), ValueError,
     r"SequenceParallelMLP: data_axes=\(\) leaves out the mesh axes \('dp',\)"),
    (lambda m: L.ColumnParallelDense(F, mesh=m, data_axes="dp", config="xla"), (N, K),
     TypeError, r"ColumnParallelDense: `config` must be a jax_comm_gemm.CommGemmConfig"),
    (lambda m: L.ColumnParallelDense(F, mesh=m, data_axes="dp", keep_gathered_input="no"),
     (N, K), TypeError, r"ColumnParallelDense: `keep_gathered_input` must be True or False"),
    (lambda m: L.SequenceParallelMLP(F, None, mesh=m, data_axes="dp"), (N, K), TypeError,
     r"SequenceParallelMLP: `activation` must be a function"),
    (lambda m: L.RowParallelDense(K, mesh=m, data_axes="dp", dot_general=3), (N, F),
     TypeError, r"RowParallelDense: `dot_general` must be a function"),
    (lambda m: L.ColumnParallelDense(F, mesh=m, data_axes=("dp",)), (0, K), ValueError,
     r"ColumnParallelDense: `inputs` has shape \(0, 16\), with a dimension of size 0"),
], ids=["missing_data_axis", "config", "keep", "activation", "dot_general", "no_tokens"])
def test_arguments_are_checked_and_named(module, x_shape, error, match):
  with pytest.raises(error, match=match):
    module(dp_tp_mesh()).init(jax.random.key(0), jnp.zeros(x_shape))


def test_shared_options_follow_the_table():
  """Every module's shared options default to the one table's values."""
  for module in (L.ColumnParallelDense(F), L.RowParallelDense(K), L.SequenceParallelMLP(F),
                 L.SequenceParallelTransformerBlock(2, F)):
    assert {name: getattr(module, name) for name in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("module", ["column", "block"])
def test_init_chooses_no_route_and_warns_not(monkeypatch, module):
  """An init's forward only makes parameters: on a connected axis with backend
  'auto', it runs on XLA's collectives, so no problem goes unmeasured (no
  warning) and no fused call is compiled into it; apply then routes as
  measured (here: not yet, so it warns)."""
  import warnings
  import jax_comm_gemm as jcg
  from fake_native import install_fake_native
  from jax_comm_gemm.runtime.constants import TARGETS
  install_fake_native(monkeypatch)
  mesh = cpu_mesh(2)
  jcg.connect(mesh, "tp")
  config = jcg.CommGemmConfig(all_gather_algorithm="pipelined_ce")
  layer = (L.ColumnParallelDense(16, mesh=mesh, axis_name="tp", config=config)
           if module == "column" else
           L.SequenceParallelTransformerBlock(2, 32, mesh=mesh, axis_name="tp", config=config))
  x = jnp.ones((16, 8) if module == "column" else (16, 1, 16), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    variables = layer.init(jax.random.key(0), x)
    init_program = str(jax.make_jaxpr(lambda k: layer.init(k, x))(jax.random.key(0)))
  assert TARGETS["all_gather_matmul"] not in init_program
  with pytest.warns(RuntimeWarning, match="is not measured"):
    jax.make_jaxpr(lambda v: layer.apply(v, x))(variables)
