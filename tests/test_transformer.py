"""The linen transformer block against an unsharded plain-Flax reference.

The reference (``ReferenceBlock``) is the same block written with
``flax.linen.LayerNorm`` and ``flax.linen.Dense`` and attention spelled out,
run in float64 on one device with the same parameters. The block runs in global
mode (under jax.jit with NamedSharding), in local mode (inside the test's own
shard_map), under ``nn.remat`` and under ``nn.scan``; forward and gradients
(parameters and input), float32 tight and bfloat16 loose, on 2, 4 and 8
simulated devices and through every routing of ``fused_emulation.ROUTINGS``.

Longer than 300 lines because the plain-Flax reference block lives beside the tests that compare against it.
"""

import hashlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from flax_helpers import OPTIONS, assert_options_show, dp_tp_mesh
from fused_emulation import ROUTINGS, relative_error, standalone_all_gathers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import linen as L
from jax_comm_gemm.layers import transformer

SEQ, BATCH, D, HEADS, F = 16, 2, 32, 8, 64  # 8 heads: whole heads on up to 8 shards
MESHES = {"tp2": lambda: cpu_mesh(2), "tp4": lambda: cpu_mesh(4),
          "tp8": lambda: cpu_mesh(8), "dp2xtp4": dp_tp_mesh}
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 4e-2}


# --- the reference: plain Flax, unsharded ---------------------------------------------

class _RefAttention(nn.Module):
  num_heads: int
  causal: bool = True

  @nn.compact
  def __call__(self, x):
    seq, batch, d = x.shape
    qkv = nn.Dense(3 * d, name="qkv")(x).reshape(seq, batch, self.num_heads, 3, -1)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    logits = jnp.einsum("sbhd,tbhd->bhst", q, k) / np.sqrt(q.shape[-1])
    mask = np.tril(np.ones((seq, seq), bool)) if self.causal else np.ones((seq, seq), bool)
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    out = jnp.einsum("bhst,tbhd->sbhd", weights, v).reshape(seq, batch, d)
    return nn.Dense(d, name="out")(out)


class _RefMLP(nn.Module):
  hidden: int
  activation: object = nn.gelu

  @nn.compact
  def __call__(self, x):
    h = self.activation(nn.Dense(self.hidden, name="fc1")(x))
    return nn.Dense(x.shape[-1], name="fc2")(h)


class ReferenceBlock(nn.Module):
  """The block, unsharded, in plain Flax: the parameter tree of the SP block."""
  num_heads: int = HEADS
  hidden: int = F
  causal: bool = True
  activation: object = nn.gelu
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    norm = lambda name: nn.LayerNorm(epsilon=self.epsilon, name=name)  # noqa: E731
    x = x + _RefAttention(self.num_heads, self.causal, name="attention")(norm("ln_1")(x))
    return x + _RefMLP(self.hidden, self.activation, name="mlp")(norm("ln_2")(x))


def x64():
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax.experimental import enable_x64  # noqa: PLC0415  (older jax)
  return enable_x64()


# The references computed so far, by their inputs: most tests (linen and NNX)
# start from the same parameters, x and ct, on whichever mesh and routing.
_REFERENCES = {}


def reference(params, x, ct, layers=None, **options):
  """(y, d params, dx) of sum(block(x) * ct) in float64; `params` is the block's
  parameter dict, or with `layers` a stack of them along a leading axis;
  `options` are ReferenceBlock's (causal, activation, epsilon). Computed once
  for the same values of the inputs and the same options."""
  params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x, ct = np.asarray(x, np.float64), np.asarray(ct, np.float64)
  digest = hashlib.sha256()
  for path, a in jax.tree_util.tree_leaves_with_path((params, x, ct)):
    digest.update(f"{jax.tree_util.keystr(path)} {a.shape};".encode())
    digest.update(np.ascontiguousarray(a).tobytes())
  key = (digest.hexdigest(), layers, tuple(sorted(options.items())))
  if key not in _REFERENCES:
    _REFERENCES[key] = _reference(params, x, ct, layers, options)
  return _REFERENCES[key]


def _reference(params, x, ct, layers, options):
  """reference's computation, on float64 numpy inputs."""

  def apply(p, x):
    if layers is None:
      return ReferenceBlock(**options).apply({"params": p}, x)
    for i in range(layers):
      x = ReferenceBlock(**options).apply({"params": jax.tree.map(lambda a: a[i], p)}, x)
    return x

  def loss(p, x):
    y = apply(p, x)
    return jnp.sum(y * ct), y

  with x64():
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return jax.tree.map(np.asarray, (y, grads))


def assert_close(what, got, want, dtype):
  err = relative_error(got, want)
  assert err <= TOLERANCE[jnp.dtype(dtype)], f"{what}: relative error {err:.3g} ({dtype})"


def assert_all_close(y, grads, ref, dtype):
  y_ref, (dparams_ref, dx_ref) = ref
  dparams, dx = grads
  assert_close("output", y, y_ref, dtype)
  assert_close("d inputs", dx, dx_ref, dtype)
  assert jax.tree.structure(dparams) == jax.tree.structure(dparams_ref)
  got = jax.tree_util.tree_leaves_with_path(dparams)
  want = jax.tree.leaves(dparams_ref)
  for (path, g), r in zip(got, want):
    assert g.dtype == jnp.float32  # gradients in the parameters' dtype
    assert_close(f"d {jax.tree_util.keystr(path)}", g, r, dtype)


# --- setting up ---------------------------------------------------------------------------

def data_axes(mesh):
  return tuple(a for a in mesh.axis_names if a != "tp")


def tokens_spec(mesh):
  return P("tp", data_axes(mesh) or None, None)


def random_params(abstract, seed=0):
  """Parameters for the shapes of `abstract` (an ``eval_shape`` of ``init``):
  kernels scaled by 1/sqrt(fan-in), LayerNorm scales near 1, and biases that
  are not zero, so that a misplaced one shows."""
  rng = np.random.default_rng(seed)

  def make(path, a):
    name = jax.tree_util.keystr(path[-1:])
    if "kernel" in name:
      return rng.normal(size=a.shape) / np.sqrt(a.shape[-2])
    return (1.0 if "scale" in name else 0.0) + 0.2 * rng.normal(size=a.shape)

  values = nn.unbox(abstract)
  return jax.tree_util.tree_map_with_path(lambda p, a: make(p, a).astype(a.dtype), values)


def setup(module, mesh, x_shape=(SEQ, BATCH, D)):
  """(params, x, ct, partition specs) for `module` (global mode) on `mesh`;
  params and x placed as their specs say. Built without running `module.init`
  (which would compile the block once more)."""
  kx, kc = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(kx, x_shape), NamedSharding(mesh, tokens_spec(mesh)))
  abstract = jax.eval_shape(module.init, jax.random.key(1), x)
  specs = nn.get_partition_spec(abstract)
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        random_params(abstract), specs)
  return params, x, jax.random.normal(kc, x_shape), specs


def block(mesh=None, **kw):
  kw.setdefault("data_axes", data_axes(mesh) if mesh is not None else ())
  return L.SequenceParallelTransformerBlock(HEADS, F, mesh=mesh, **kw)


def run(apply, params, x, ct):
  """(y, (d params, dx)) of sum(apply(params, x) * ct), in one jax.jit."""

  def loss(p, x):
    y = apply(p, x)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, x)
  return y, (dparams["params"], dx)


# --- global mode ----------------------------------------------------------------------

# 2, 4 and 8 devices through XLA and the emulated fused ops that hand out their
# gathered operand; every routing on the data-parallel mesh.
GLOBAL_CASES = ([(m, r) for m in ("tp2", "tp4", "tp8") for r in ("xla", "fused_expose")]
                + [("dp2xtp4", r) for r in ROUTINGS])


@pytest.mark.parametrize("mesh_name, routing", GLOBAL_CASES)
def test_global_mode_matches_reference(mesh_name, routing):
  mesh = MESHES[mesh_name]()
  model = block(mesh, config=ROUTINGS[routing])
  params, x, ct, specs = setup(model, mesh)
  y, grads = run(model.apply, params, x, ct)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, tokens_spec(mesh)), 3)
  assert_all_close(y, grads, reference(params["params"], x, ct), jnp.float32)


def test_block_options_reach_the_block():
  """Not causal, another activation and an epsilon that matters (the inputs'
  variance is of its order), against the reference with the same options."""
  mesh = cpu_mesh(2)
  options = dict(causal=False, activation=nn.relu, epsilon=0.5)
  model = block(mesh, config=ROUTINGS["fused_expose"], **options)
  params, x, ct, specs = setup(model, mesh)
  y, grads = run(model.apply, params, x, ct)
  assert_all_close(y, grads, reference(params["params"], x, ct, **options), jnp.float32)


def test_precision_reaches_every_dense_gemm():
  """Forward and backward, the four dense layers' twelve GEMMs run at the
  block's precision (attention's own products at jax's default)."""
  mesh = cpu_mesh(2)
  options = transformer.BlockOptions(num_heads=HEADS, precision=jax.lax.Precision.HIGHEST,
                                     config=ROUTINGS["xla"])
  params = jax.tree.map(lambda s: jnp.ones(s.shape), transformer.param_layout(D, F, "tp"),
                        is_leaf=lambda v: isinstance(v, transformer.ParamSpec))
  loss = lambda p, x: jnp.sum(transformer.sharded_transformer_block(  # noqa: E731
      x, p, mesh=mesh, options=options))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, jnp.ones((SEQ, BATCH, D))))
  assert jaxpr.count("Precision.HIGHEST") == 2 * 12  # (lhs, rhs) per dot


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
def test_module_options_reach_the_block():
  """The module's precision (every dense GEMM), config (the ring's ppermutes)
  and keep_gathered_input (no all-gather left in the backward pass, with a
  fused op that hands out its operand) reach the block."""
  mesh = cpu_mesh(2)

  def step(**kw):
    model = block(mesh, **kw)
    params, x, ct, _ = setup(model, mesh)
    grad = jax.grad(lambda p, x: jnp.sum(model.apply(p, x) * ct), argnums=(0, 1))
    return jax.jit(grad), (params, x)

  assert_options_show(*step(**OPTIONS), every_dot=False)
  fused = ROUTINGS["fused_expose"]
  assert standalone_all_gathers(*step(config=fused)) == 2
  assert standalone_all_gathers(*step(config=fused, keep_gathered_input=True)) == 0


def test_attention_implementation_reaches_jax():
  """jax is asked for the implementation named: cuDNN's, on a CPU, fails."""
  mesh = cpu_mesh(2)
  params, x, _, _ = setup(block(mesh), mesh)
  with pytest.raises(RuntimeError, match="cuDNN"):
    jax.jit(block(mesh, attention_implementation="cudnn").apply)(params, x)


@pytest.mark.parametrize("axes, says", [
    (("tp",), r"data_axes=\('tp',\) must not contain the tensor-parallel axis 'tp'"),
    (("dq",), r"data_axes=\('dq',\) names 'dq', which is not an axis of the mesh"),
])
def test_data_axes_are_checked_first(axes, says):
  options = transformer.BlockOptions(num_heads=HEADS)
  with pytest.raises(ValueError, match=says):
    transformer.sharded_transformer_block(jnp.zeros((SEQ, BATCH, D)), {}, mesh=dp_tp_mesh(),
                                          data_axes=axes, options=options)


@pytest.mark.parametrize("routing", ["xla", "fused_expose"])
def test_global_mode_bfloat16(routing):
  mesh = dp_tp_mesh()
  model = block(mesh, dtype=jnp.bfloat16, config=ROUTINGS[routing])
  params, x, ct, specs = setup(model, mesh)
  y, grads = run(model.apply, params, x, ct)
  assert y.dtype == jnp.bfloat16
  assert_all_close(y, grads, reference(params["params"], x, ct), jnp.bfloat16)


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep"])
def test_remat(keep):
  mesh = dp_tp_mesh()
  model = nn.remat(L.SequenceParallelTransformerBlock)(
      HEADS, F, mesh=mesh, data_axes=("dp",), keep_gathered_input=keep,
      config=ROUTINGS["fused_expose"])
  params, x, ct, specs = setup(model, mesh)
  y, grads = run(model.apply, params, x, ct)
  assert_all_close(y, grads, reference(params["params"], x, ct), jnp.float32)


class _Layer(nn.Module):
  """A block with nn.scan's (carry, x) -> (carry, y) signature."""
  mesh: object
  config: object

  @nn.compact
  def __call__(self, x, _):
    return block(self.mesh, config=self.config, name="block")(x), None


class _Stack(nn.Module):
  mesh: object
  config: object
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(nn.remat(_Layer), variable_axes={"params": 0},
                   split_rngs={"params": True}, length=self.layers,
                   metadata_params={nn.PARTITION_NAME: None})
    return scan(self.mesh, self.config, name="layers")(x, None)[0]


def test_scan_over_remat_layers():
  mesh = dp_tp_mesh()
  model = _Stack(mesh, ROUTINGS["fused_expose"])
  params, x, ct, specs = setup(model, mesh)
  assert specs["params"]["layers"]["block"]["attention"]["qkv"]["kernel"] == P(
      None, None, "tp")
  y, grads = run(model.apply, params, x, ct)
  stacked = params["params"]["layers"]["block"]
  y_ref, (dp_ref, dx_ref) = reference(stacked, x, ct, layers=3)
  assert_all_close(y, ({"layers": {"block": grads[0]["layers"]["block"]}}, grads[1]),
                   (y_ref, ({"layers": {"block": dp_ref}}, dx_ref)), jnp.float32)


# --- local mode -----------------------------------------------------------------------

@pytest.mark.parametrize("mesh_name, routing", [("tp2", "xla"), ("dp2xtp4", "fused_expose")])
def test_local_mode_inside_shard_map(mesh_name, routing):
  mesh = MESHES[mesh_name]()
  params, x, ct, specs = setup(block(mesh, config=ROUTINGS[routing]), mesh)
  local = block(config=ROUTINGS[routing])  # no mesh, no data axes: the shard_map's
  seen = []

  def body(params, x):
    seen.append(x.shape)
    return local.apply(params, x)

  apply = jax.shard_map(body, mesh=mesh, in_specs=(specs,
                                                   tokens_spec(mesh)),
                        out_specs=tokens_spec(mesh))
  y, grads = run(apply, params, x, ct)
  size, shards = mesh.shape["tp"], mesh.size // mesh.shape["tp"]
  assert seen[0] == (SEQ // size, BATCH // shards, D)
  assert_all_close(y, grads, reference(params["params"], x, ct), jnp.float32)


# --- parameters and errors ------------------------------------------------------------

def test_parameters_and_partitioning():
  mesh = cpu_mesh(4)
  model = block(mesh)
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((SEQ, BATCH, D)))
  assert jax.tree.map(jnp.shape, nn.unbox(abstract))["params"] == {
      "ln_1": {"scale": (D,), "bias": (D,)}, "ln_2": {"scale": (D,), "bias": (D,)},
      "attention": {"qkv": {"kernel": (D, 3 * D), "bias": (3 * D,)},
                    "out": {"kernel": (D, D), "bias": (D,)}},
      "mlp": {"fc1": {"kernel": (D, F), "bias": (F,)}, "fc2": {"kernel": (F, D), "bias": (D,)}}}
  specs = nn.get_partition_spec(abstract)["params"]
  assert specs["attention"] == {"qkv": {"kernel": P(None, "tp"), "bias": P("tp")},
                                "out": {"kernel": P("tp", None), "bias": P(None)}}
  assert specs["ln_1"] == {"scale": P(None), "bias": P(None)}
  assert specs["mlp"]["fc2"] == {"kernel": P("tp", None), "bias": P(None)}
  no_bias = jax.eval_shape(block(mesh, use_bias=False).init, jax.random.key(0),
                           jnp.zeros((SEQ, BATCH, D)))
  assert "bias" not in nn.unbox(no_bias)["params"]["mlp"]["fc1"]


@pytest.mark.parametrize("build, shape, match", [
    (lambda m: L.SequenceParallelTransformerBlock(6, F, mesh=m), (SEQ, BATCH, 36),
     r"SequenceParallelTransformerBlock\.num_heads=6 is not divisible by the size 4"),
    (lambda m: L.SequenceParallelTransformerBlock(HEADS, 34, mesh=m), (SEQ, BATCH, D),
     r"SequenceParallelTransformerBlock\.hidden_features=34 is not divisible"),
    (lambda m: L.SequenceParallelTransformerBlock(HEADS, F, mesh=m), (SEQ, BATCH, 36),
     r"SequenceParallelTransformerBlock: the features \(36\) must divide into num_heads=8"),
    (lambda m: L.SequenceParallelTransformerBlock(HEADS, F, mesh=m), (SEQ * BATCH, D),
     r"SequenceParallelTransformerBlock: `inputs` must be 3-D \[seq, batch, features\]"),
    (lambda m: L.SequenceParallelTransformerBlock(HEADS, F, mesh=m), (BATCH, SEQ, D),
     r"`inputs` has 2 positions .*not divisible by the size 4.* jnp\.swapaxes\(x, 0, 1\)"),
    (lambda m: L.SequenceParallelTransformerBlock(HEADS, F, mesh=m, axis_name="model"),
     (SEQ, BATCH, D), r"SequenceParallelTransformerBlock: axis_name='model' is not an axis"),
])
def test_config_errors(build, shape, match):
  # Raised while init traces the block: eval_shape traces it alike, without
  # running init's ops one by one.
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(build(cpu_mesh(4)).init, jax.random.key(0), jnp.zeros(shape))


def test_batch_must_split_over_the_data_axes():
  model = block(dp_tp_mesh())
  with pytest.raises(ValueError, match=r"`inputs` has 3 sequences .* 'dp'"):
    model.init(jax.random.key(0), jnp.zeros((SEQ, 3, D)))


@pytest.mark.parametrize("kw, error, match", [
    (dict(data_axes=()), ValueError,
     r"SequenceParallelTransformerBlock: data_axes=\(\) leaves out the mesh axes \('dp',\)"),
    (dict(config="xla"), TypeError,
     r"SequenceParallelTransformerBlock: `config` must be a jax_comm_gemm.CommGemmConfig"),
    (dict(activation=None), TypeError,
     r"SequenceParallelTransformerBlock: `activation` must be a function"),
    (dict(keep_gathered_input="yes"), TypeError,
     r"SequenceParallelTransformerBlock: `keep_gathered_input` must be True or False"),
], ids=["missing_data_axis", "config", "activation", "keep"])
def test_block_arguments_are_checked_and_named(kw, error, match):
  mesh = dp_tp_mesh()
  with pytest.raises(error, match=match):
    jax.eval_shape(block(mesh, **kw).init, jax.random.key(0), jnp.zeros((SEQ, BATCH, D)))


def test_block_options_are_checked():
  with pytest.raises(TypeError, match=r"BlockOptions: `activation` must be a function"):
    transformer.BlockOptions(num_heads=HEADS, activation=None)
  with pytest.raises(TypeError, match=r"BlockOptions: `config` must be a jax_comm_gemm"):
    transformer.BlockOptions(num_heads=HEADS, config={"backend": "xla"})
  assert transformer.BlockOptions(num_heads=HEADS, causal=np.False_).causal is False
  with pytest.raises(TypeError, match=r"sharded_transformer_block: `options` must be a "
                                      r"BlockOptions"):
    transformer.sharded_transformer_block(jnp.zeros((SEQ, BATCH, D)), {}, mesh=cpu_mesh(2),
                                          options={"num_heads": HEADS})
