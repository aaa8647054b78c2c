"""The layers on global arrays (``jax_comm_gemm.sharded``) under ``jax.jit``.

Inputs are placed with ``NamedSharding`` as the layers document; outputs and
gradients are compared with the plain layer on one device in float64, on a
1-D ``('tp',)`` mesh and on a 2-D ``('dp', 'tp')`` mesh with data parallelism
(``data_axes=('dp',)``), and the outputs must come back sharded as documented.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from fused_emulation import ROUTINGS, check_against_reference, random_inputs
from jax_comm_gemm import sharded

N, S, K, F = 16, 2, 16, 32  # tokens, extra dimension, hidden, MLP features
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _mesh(kind: str) -> tuple[Mesh, tuple[str, ...]]:
  """The mesh and the data axes of a test."""
  if kind == "tp":
    return cpu_mesh(4), ()
  devices = jax.devices("cpu")
  if len(devices) < 8:
    pytest.skip("needs 8 CPU devices")
  return Mesh(np.asarray(devices[:8]).reshape(2, 4), ("dp", "tp")), ("dp",)


def _placed(mesh, args, specs):
  return [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]


def _run(kind, layer, reference, shapes, specs, names, out_spec, dtype, routing):
  """Checks `layer(*args, mesh=..., data_axes=..., config=...)` against
  `reference` and the output's sharding against `out_spec(data_axes)`."""
  mesh, data = _mesh(kind)
  seed = zlib.crc32(repr((layer.__name__, kind, dtype, routing)).encode())
  args = _placed(mesh, random_inputs(seed, shapes, dtype), specs(data))

  def fn(*args):
    return (layer(*args, mesh=mesh, data_axes=data, config=ROUTINGS[routing]),)

  out_shape = jax.eval_shape(lambda *a: reference(*a)[0], *args).shape
  (out,), _ = check_against_reference(fn, reference, args, [out_shape], dtype, seed,
                                      arg_names=names)
  expected = NamedSharding(mesh, out_spec(data))
  assert out.sharding.is_equivalent_to(expected, out.ndim), (
      f"output sharded as {out.sharding}, documented {expected.spec}")


def _tokens(data):
  return P((*data, "tp"), None, None)


CASES = ["tp", "dp_tp"]


@pytest.mark.parametrize("routing", ["xla", "fused_hidden"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", CASES)
def test_column_parallel_dense(kind, dtype, routing):
  """x [n, s, K] sharded along tokens -> [n, s, F] sharded along F (and the
  tokens along the data axes)."""
  _run(kind, sharded.column_parallel_dense,
       lambda x, kernel, bias: (x @ kernel + bias,),
       [(N, S, K), (K, F), (F,)],
       lambda data: [_tokens(data), P(None, "tp"), P("tp")],
       ("x", "kernel", "bias"),
       lambda data: P(data or None, None, "tp"), dtype, routing)


@pytest.mark.parametrize("routing", ["xla", "fused_hidden"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", CASES)
def test_row_parallel_dense(kind, dtype, routing):
  """h [n, s, F] sharded along F -> [n, s, K] sharded along tokens; the
  replicated bias's gradient sums over all tokens of all shards."""
  _run(kind, sharded.row_parallel_dense,
       lambda h, kernel, bias: (h @ kernel + bias,),
       [(N, S, F), (F, K), (K,)],
       lambda data: [P(data or None, None, "tp"), P("tp", None), P()],
       ("h", "kernel", "bias"), _tokens, dtype, routing)


def _mlp_reference(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias):
  return (jax.nn.gelu(x @ fc1_kernel + fc1_bias) @ fc2_kernel + fc2_bias,)


MLP_SHAPES = [(N, S, K), (K, F), (F, K), (F,), (K,)]
MLP_NAMES = ("x", "fc1_kernel", "fc2_kernel", "fc1_bias", "fc2_bias")


def _mlp_specs(data):
  return [_tokens(data), P(None, "tp"), P("tp", None), P("tp"), P()]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", CASES)
def test_mlp(kind, dtype, routing):
  """The MLP block on global arrays, tokens sharded in and out."""
  _run(kind, sharded.mlp, _mlp_reference, MLP_SHAPES, _mlp_specs, MLP_NAMES,
       _tokens, dtype, routing)


def test_mlp_keep_gathered_input_under_set_mesh():
  """mesh=None takes the mesh from ``jax.set_mesh``; keep_gathered_input=True
  gives the same numbers (2-D mesh, data parallel)."""
  mesh, data = _mesh("dp_tp")
  seed = 5
  args = _placed(mesh, random_inputs(seed, MLP_SHAPES, jnp.float32), _mlp_specs(data))

  def fn(*args):
    return (sharded.mlp(*args, data_axes=data, keep_gathered_input=True),)

  with jax.set_mesh(mesh):
    (out,), _ = check_against_reference(fn, _mlp_reference, args, [(N, S, K)],
                                        jnp.float32, seed, arg_names=MLP_NAMES)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, _tokens(data)), out.ndim)


# --- data axes, dot_general and the argument checks -------------------------------------

def _spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


LAYERS = {
    "column": lambda x, **kw: sharded.column_parallel_dense(x, _spec((K, F)), **kw),
    "row": lambda x, **kw: sharded.row_parallel_dense(x, _spec((K, F)), **kw),
    "mlp": lambda x, **kw: sharded.mlp(x, _spec((K, F)), _spec((F, K)), **kw),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_a_missing_data_axis_is_an_error(layer):
  """On a ('dp', 'tp') mesh, data_axes=() would replicate the layer over 'dp'
  (gathering whatever the caller sharded over it): a ValueError names data_axes."""
  mesh, _ = _mesh("dp_tp")
  with pytest.raises(ValueError, match=r"data_axes=\(\) leaves out the mesh axes \('dp',\) "
                                       r"\(sizes \(2,\)\).*Pass data_axes=\('dp',\)"):
    jax.eval_shape(lambda x: LAYERS[layer](x, mesh=mesh), _spec((N, K)))


def test_a_data_axis_of_size_one_may_be_left_out():
  mesh = Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(1, 4), ("dp", "tp"))
  out = jax.eval_shape(lambda x: LAYERS["mlp"](x, mesh=mesh), _spec((N, K)))
  assert out.shape == (N, K)


def test_data_axes_may_be_one_name():
  """data_axes="dp" is the axis 'dp' (it was read as ('d', 'p'))."""
  mesh, _ = _mesh("dp_tp")
  x = jax.device_put(jnp.ones((N, K)), NamedSharding(mesh, P(("dp", "tp"))))
  kernel = jax.device_put(jnp.ones((K, F)), NamedSharding(mesh, P(None, "tp")))
  y = sharded.column_parallel_dense(x, kernel, mesh=mesh, data_axes="dp")
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp")), 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(config="xla"), TypeError, r"`config` must be a jax_comm_gemm.CommGemmConfig, got "
                                    r"'xla' \(str\); e.g. config=CommGemmConfig\(backend='xla'\)"),
    (dict(config={"backend": "xla"}), TypeError, r"`config` must be a jax_comm_gemm"),
    (dict(config=1), TypeError, r"`config` must be a jax_comm_gemm"),
    (dict(keep_gathered_input=np.True_), None, None),
    (dict(keep_gathered_input=1), TypeError, r"`keep_gathered_input` must be True or False"),
    (dict(data_axes=3), TypeError, r"data_axes must be a mesh axis name or a sequence"),
    (dict(mesh="tp"), TypeError, r"`mesh` must be a jax.sharding.Mesh or None"),
])
def test_options_are_checked_and_named(kwargs, error, match):
  call = lambda: jax.eval_shape(  # noqa: E731
      lambda x: sharded.column_parallel_dense(x, _spec((K, F)), **({"mesh": cpu_mesh(2)}
                                                                   | kwargs)), _spec((N, K)))
  if error is None:
    assert call().shape == (N, F)
    return
  with pytest.raises(error, match=r"sharded.column_parallel_dense: " + match):
    call()


@pytest.mark.parametrize("x_shape, kernel_shape, match", [
    ((0, K), (K, F), r"`x` has shape \(0, 16\), with a dimension of size 0"),
    ((N, 0), (0, F), r"`x` has shape \(16, 0\), with a dimension of size 0"),
    ((N, K), (K, 0), r"`kernel` has shape \(16, 0\), with a dimension of size 0"),
])
def test_zero_size_dimensions_are_named(x_shape, kernel_shape, match):
  with pytest.raises(ValueError, match=r"sharded.column_parallel_dense: " + match):
    jax.eval_shape(lambda x, k: sharded.column_parallel_dense(x, k, mesh=cpu_mesh(2)),
                   _spec(x_shape), _spec(kernel_shape))


def test_bias_of_another_dtype_is_refused():
  with pytest.raises(TypeError, match=r"sharded.row_parallel_dense: `bias` has dtype float32 "
                                      r"but `h` has bfloat16"):
    jax.eval_shape(lambda h, k, b: sharded.row_parallel_dense(h, k, b, mesh=cpu_mesh(2)),
                   _spec((N, F), jnp.bfloat16), _spec((F, K), jnp.bfloat16), _spec((K,)))


def test_mlp_activation_none_is_named():
  with pytest.raises(TypeError, match=r"sharded.mlp: `activation` must be a function"):
    jax.eval_shape(lambda x: LAYERS["mlp"](x, mesh=cpu_mesh(2), activation=None),
                   _spec((N, K)))


@pytest.mark.parametrize("layer", ["column", "row"])
def test_injected_dot_general_on_global_arrays(layer):
  """The injected dot_general is called on the global arrays (no shard_map,
  so a Flax module can be the dot_general) and the output is sharded as the
  fused layer's."""
  mesh, data = _mesh("dp_tp")
  calls = []

  def dot(*args, **kwargs):
    calls.append(1)
    return jax.lax.dot_general(*args, **kwargs)

  x_spec, out_spec = ((_tokens(data), P(data, None, "tp")) if layer == "column"
                      else (P(data, None, "tp"), _tokens(data)))
  width = K if layer == "column" else F
  x, kernel = random_inputs(3, [(N, S, width), (width, K + F - width)], jnp.float32)
  fn = sharded.column_parallel_dense if layer == "column" else sharded.row_parallel_dense
  kernel_spec = P(None, "tp") if layer == "column" else P("tp", None)
  x, kernel = _placed(mesh, [x, kernel], [x_spec, kernel_spec])
  y = jax.jit(lambda x, k: fn(x, k, mesh=mesh, data_axes=data, dot_general=dot))(x, kernel)
  assert calls == [1]
  np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(kernel), rtol=1e-4, atol=1e-4)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), y.ndim)
