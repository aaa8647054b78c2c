"""The four parallel dense modules take what Flax's Dense / Linear take.

Ported from Flax's own tests of ``nn.Dense`` and ``nnx.Linear``: values
against the plain module at tp 1 and 2, initialisers, dtype promotion,
precision, an injected ``dot_general`` (and linen's ``dot_general_cls``,
Flax's FP8 hook) being called, and NNX split/merge. An injected dot product
runs on XLA's collectives, and ``path_reason()`` says why.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
import jax_comm_gemm.linen as jl
from jax_comm_gemm.diagnostics import report
from flax import nnx
from flax.linen import fp8_ops
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import linen as L
from jax_comm_gemm import nnx as N

T, K, F = 8, 4, 6  # tokens, input width, output width (both split over 2)
HIGHEST = jax.lax.Precision.HIGHEST


def _x(width, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(7), (T, width), dtype)


def _placed(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


class Spy:
  """A dot_general that records its keyword arguments."""

  def __init__(self):
    self.calls = []

  def __call__(self, *args, **kwargs):
    self.calls.append(kwargs)
    return jax.lax.dot_general(*args, **kwargs)


# --- linen -----------------------------------------------------------------------

LINEN = {"column": (L.ColumnParallelDense, K, P("tp")),
         "row": (L.RowParallelDense, F, P(None, "tp"))}


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("kind", LINEN)
def test_linen_values_and_init_match_dense(kind, size):
  """Same key, same parameters as nn.Dense (the initialisers see the global
  shapes), and the same output."""
  cls, width, spec = LINEN[kind]
  mesh = cpu_mesh(size)
  x = _placed(mesh, _x(width), spec)
  kw = dict(bias_init=nn.initializers.normal(1.0), precision=HIGHEST)
  params = cls(width + 2, mesh=mesh, **kw).init(jax.random.key(0), x)
  plain = nn.Dense(width + 2, **kw)
  plain_params = plain.init(jax.random.key(0), np.asarray(x))
  # Exact: both call the same initializers outside jit, op by op, on the same
  # key and shapes: the same executables on the same bits.
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(params), plain_params)
  y = jax.jit(cls(width + 2, mesh=mesh, **kw).apply)(params, x)
  np.testing.assert_allclose(y, plain.apply(plain_params, np.asarray(x)), rtol=1e-5,
                             atol=1e-5)


def test_linen_dtype_promotion_and_custom_promote_dtype():
  """As nn.Dense: params bfloat16, input float32 -> float32; a promote_dtype
  of the caller's is called with (inputs, kernel, bias) and dtype."""
  mesh = cpu_mesh(2)
  x = _placed(mesh, _x(K), P("tp"))
  layer = L.ColumnParallelDense(F, mesh=mesh, param_dtype=jnp.bfloat16)
  params = layer.init(jax.random.key(0), x)
  assert layer.apply(params, x).dtype == jnp.float32
  seen = []

  def promote(*arrays, dtype=None):
    seen.append((len(arrays), dtype))
    return nn.dtypes.promote_dtype(*arrays, dtype=jnp.bfloat16)

  custom = L.ColumnParallelDense(F, mesh=mesh, promote_dtype=promote)
  assert custom.apply(params, x).dtype == jnp.bfloat16
  assert seen == [(3, None)]


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("kind", LINEN)
def test_linen_injected_dot_general_is_called(kind, local):
  """The injected dot_general gets Flax's call (precision included), runs on
  XLA's collectives, gives Dense's values, and path_reason says why."""
  cls, width, spec = LINEN[kind]
  mesh = cpu_mesh(2)
  spy = Spy()
  x = _placed(mesh, _x(width), spec)
  layer = cls(width + 2, mesh=mesh, dot_general=spy, precision=HIGHEST)
  params = layer.init(jax.random.key(0), x)
  apply = layer.apply
  if local:
    out = P(None, "tp") if kind == "column" else P("tp")
    apply = jax.shard_map(cls(width + 2, dot_general=spy, precision=HIGHEST).apply,
                          mesh=mesh, in_specs=(nn.get_partition_spec(params), spec),
                          out_specs=out)
  spy.calls.clear()
  y = jax.jit(apply)(params, x)
  assert spy.calls and all(c["precision"] == HIGHEST for c in spy.calls)
  plain = nn.Dense(width + 2, precision=HIGHEST).apply(nn.unbox(params), np.asarray(x))
  np.testing.assert_allclose(y, plain, rtol=1e-5, atol=1e-5)
  steps = "lax.all_gather, then the dot" if kind == "column" else "the dot, then lax.psum_scatter"
  assert layer.path_reason() == (f"dot_general is injected: the fused kernels cannot call it, "
                                 f"so the layer runs on XLA's collectives ({steps})")
  assert cls(4).path_reason() is None


def test_linen_dot_general_cls_runs_flax_fp8_ops():
  """dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp (Flax's FP8 injection; it
  replaces the deprecated Fp8DotGeneralOp): the op's own
  variables appear beside the layer's, and the output is close to Dense's."""
  mesh = cpu_mesh(2)
  x = _placed(mesh, _x(K), P("tp"))
  layer = L.ColumnParallelDense(F, mesh=mesh, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
  variables = layer.init(jax.random.key(0), x)
  assert "_overwrite_with_gradient" in variables
  y = jax.jit(layer.apply)(variables, x)
  plain = nn.Dense(F).apply({"params": nn.unbox(variables)["params"]}, np.asarray(x))
  np.testing.assert_allclose(y, plain, rtol=0.15, atol=0.15)
  assert layer.path_reason().startswith("dot_general_cls is injected")


# --- NNX -------------------------------------------------------------------------

NNX = {"column": (N.ColumnParallelDense, K, P("tp")),
       "row": (N.RowParallelDense, F, P(None, "tp"))}


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("kind", NNX)
def test_nnx_values_and_init_match_linear(kind, size):
  cls, width, spec = NNX[kind]
  mesh = cpu_mesh(size)
  kw = dict(bias_init=nnx.initializers.normal(1.0), precision=HIGHEST)
  layer = cls(width, width + 2, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  plain = nnx.Linear(width, width + 2, rngs=nnx.Rngs(0), **kw)
  # Exact: the same initializers, op by op outside jit, on the same keys and shapes.
  np.testing.assert_array_equal(layer.kernel[...], plain.kernel[...])
  np.testing.assert_array_equal(layer.bias[...], plain.bias[...])
  x = _placed(mesh, _x(width), spec)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), plain(np.asarray(x)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", NNX)
def test_nnx_linear_arguments(kind):
  """dot_general (called with Linear's arguments), preferred_element_type,
  kernel_metadata and bias_metadata, as nnx.Linear takes them; split/merge
  keeps the module's behaviour."""
  cls, width, spec = NNX[kind]
  mesh = cpu_mesh(2)
  spy = Spy()
  layer = cls(width, width + 2, mesh=mesh, rngs=nnx.Rngs(0), dot_general=spy,
              preferred_element_type=jnp.float32, kernel_metadata={"note": "k"},
              bias_metadata={"note": "b"}, param_dtype=jnp.bfloat16)
  assert layer.kernel.get_metadata("note") == "k" and layer.bias.get_metadata("note") == "b"
  graphdef, state = nnx.split(layer)
  x = _placed(mesh, _x(width, jnp.bfloat16), spec)
  y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  assert y.dtype == jnp.float32  # preferred_element_type reaches the dot
  assert spy.calls[-1] == {"precision": None, "out_sharding": None,
                           "preferred_element_type": jnp.float32}
  assert layer.path_reason().startswith("dot_general is injected")
  plain = cls(width, width + 2, mesh=mesh, rngs=nnx.Rngs(0), preferred_element_type=jnp.float32)
  assert plain.path_reason().startswith("preferred_element_type=float32 is set")
  assert cls(width, width + 2, rngs=nnx.Rngs(0)).path_reason() is None


def test_nnx_metadata_may_not_reshard():
  with pytest.raises(ValueError, match=r"ColumnParallelDense: `kernel_metadata` must not set "
                                       r"out_sharding"):
    N.ColumnParallelDense(K, F, rngs=nnx.Rngs(0), kernel_metadata={"out_sharding": ("tp",)})


def test_nnx_unknown_argument_is_a_type_error():
  with pytest.raises(TypeError, match=r"RowParallelDense\.__init__\(\) got an unexpected "
                                      r"keyword argument 'dot_general_cls'"):
    N.RowParallelDense(F, K, rngs=nnx.Rngs(0), dot_general_cls=object)


def test_the_report_says_why_an_injected_dot_general_runs_on_xla():
  mesh = cpu_mesh(2)
  layer = jl.ColumnParallelDense(8, mesh=mesh, dot_general=jax.lax.dot_general)
  row = report.layer_path(layer.config, mesh, "tp", "float32", path_reason=layer.path_reason())
  assert row.path == report.XLA_FALLBACK and "dot_general is injected" in row.reason
