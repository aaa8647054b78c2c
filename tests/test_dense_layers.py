"""The per-shard dense layers (``jax_comm_gemm.dense``) inside ``jax.shard_map``.

Inputs are 3-D, ``[n, s, features]`` with the tokens ``n`` sharded, and every
layer has biases. Outputs and gradients (kernels and biases included) are
compared with the plain layer on one device in float64, for every routing of
the gathered operand, in float32 and bfloat16.
"""

import zlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from fused_emulation import ROUTINGS, check_against_reference, random_inputs
from jax_comm_gemm import dense

N, S, K, F = 16, 3, 16, 32  # tokens, extra dimension, hidden, MLP features
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
TOKENS = P("tp", None, None)
FEATURES = P(None, None, "tp")


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _run(mesh, local, in_specs, out_spec, reference, shapes, dtype, names, seed):
  args = random_inputs(seed, shapes, dtype)
  sharded = jax.shard_map(lambda *a: (local(*a),), mesh=mesh, in_specs=in_specs,
                          out_specs=(out_spec,))
  out_shape = jax.eval_shape(lambda *a: reference(*a)[0], *args).shape
  check_against_reference(sharded, reference, args, [out_shape], dtype, seed,
                          arg_names=names)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_column_parallel_dense(dtype, routing):
  """AG(x) @ kernel + bias, [n/P, s, K] -> [n, s, F/P], and its gradients."""
  config = ROUTINGS[routing]

  def local(x, kernel, bias):
    return dense.column_parallel_dense(x, kernel, bias, axis_name="tp", config=config)

  _run(cpu_mesh(4), local, (TOKENS, P(None, "tp"), P("tp")), FEATURES,
       lambda x, kernel, bias: (x @ kernel + bias,), [(N, S, K), (K, F), (F,)],
       dtype, ("x", "kernel", "bias"), _seed("column", dtype, routing))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_parallel_dense(dtype, routing):
  """RS(h @ kernel) + bias, [n, s, F/P] -> [n/P, s, K], with the replicated
  bias's gradient summed over every shard's tokens."""
  config = ROUTINGS[routing]

  def local(h, kernel, bias):
    return dense.row_parallel_dense(h, kernel, bias, axis_name="tp", config=config)

  _run(cpu_mesh(4), local, (FEATURES, P("tp", None), P()), TOKENS,
       lambda h, kernel, bias: (h @ kernel + bias,), [(N, S, F), (F, K), (K,)],
       dtype, ("h", "kernel", "bias"), _seed("row", dtype, routing))


def _mlp_reference(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias):
  return (jax.nn.gelu(x @ fc1_kernel + fc1_bias) @ fc2_kernel + fc2_bias,)


def _run_mlp(mesh, dtype, routing, keep_gathered_input):
  config = ROUTINGS[routing]

  def local(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias):
    return dense.mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, axis_name="tp",
                     keep_gathered_input=keep_gathered_input, config=config)

  _run(mesh, local, (TOKENS, P(None, "tp"), P("tp", None), P("tp"), P()), TOKENS,
       _mlp_reference, [(N, S, K), (K, F), (F, K), (F,), (K,)], dtype,
       ("x", "fc1_kernel", "fc2_kernel", "fc1_bias", "fc2_bias"),
       _seed("mlp", mesh.shape["tp"], dtype, routing, keep_gathered_input))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mlp(dtype, routing):
  """fc2(gelu(fc1(x))) with biases, tokens sharded in and out."""
  _run_mlp(cpu_mesh(4), dtype, routing, keep_gathered_input=False)


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("routing", ROUTINGS)
def test_mlp_keep_gathered_input(routing):
  """The same with fc1's gathered input kept for its weight gradient."""
  _run_mlp(cpu_mesh(4), jnp.float32, routing, keep_gathered_input=True)


@pytest.mark.parametrize("size", [2, 8])
def test_mlp_other_axis_sizes(size):
  """The MLP block on 2 and 8 devices (fused op, operand exposed)."""
  _run_mlp(cpu_mesh(size), jnp.float32, "fused_expose", keep_gathered_input=False)


def test_layers_without_bias():
  """bias=None leaves the bias out (column- and row-parallel, 2 devices)."""
  mesh = cpu_mesh(2)

  def local(x, k1, k2):
    h = dense.column_parallel_dense(x, k1, axis_name="tp")
    return dense.row_parallel_dense(h, k2, axis_name="tp")

  _run(mesh, local, (TOKENS, P(None, "tp"), P("tp", None)), TOKENS,
       lambda x, k1, k2: ((x @ k1) @ k2,), [(N, S, K), (K, F), (F, K)],
       jnp.float32, ("x", "fc1_kernel", "fc2_kernel"), _seed("no_bias"))


# --- argument checks that name the argument -------------------------------------------

def _trace_local(fn, in_specs, *arrays):
  f = jax.shard_map(fn, mesh=cpu_mesh(2), in_specs=in_specs, out_specs=P(), check_vma=False)
  return jax.eval_shape(f, *arrays)


COLUMN_SPECS = (P("tp"), P(None, "tp"), P("tp"))


@pytest.mark.parametrize("x_shape, kernel_shape, bias_shape, match", [
    ((0, K), (K, F), (F,), r"`x` has shape \(0, 16\), with a dimension of size 0"),
    ((N, 0), (0, F), (F,), r"`x` has shape \(8, 0\), with a dimension of size 0"),
    ((N, K), (K, 0), (0,), r"`kernel` has shape \(16, 0\), with a dimension of size 0"),
], ids=["no_tokens", "no_features", "no_outputs"])
def test_zero_size_dimensions_are_named(x_shape, kernel_shape, bias_shape, match):
  """Empty dimensions raise a ValueError naming the argument (they raised
  ZeroDivisionError, or failed in MLIR's verifier)."""
  arrays = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (x_shape, kernel_shape, bias_shape)]
  with pytest.raises(ValueError, match=r"column_parallel_dense: " + match):
    _trace_local(lambda x, k, b: dense.column_parallel_dense(x, k, b, axis_name="tp"),
                 COLUMN_SPECS, *arrays)


def test_bias_of_another_dtype_is_refused():
  """A float32 bias would make a bfloat16 layer's output float32."""
  arrays = [jax.ShapeDtypeStruct(s, d) for s, d in [((N, K), jnp.bfloat16),
                                                    ((K, F), jnp.bfloat16), ((F,), jnp.float32)]]
  with pytest.raises(TypeError, match=r"column_parallel_dense: `bias` has dtype float32 but "
                                      r"`x` has bfloat16"):
    _trace_local(lambda x, k, b: dense.column_parallel_dense(x, k, b, axis_name="tp"),
                 COLUMN_SPECS, *arrays)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(config="xla"), TypeError, r"`config` must be a jax_comm_gemm.CommGemmConfig"),
    (dict(config=None), TypeError, r"`config` must be a jax_comm_gemm.CommGemmConfig"),
    (dict(keep_gathered_input="no"), TypeError, r"`keep_gathered_input` must be True or False"),
    (dict(activation=None), TypeError, r"`activation` must be a function"),
])
def test_mlp_options_are_named(kwargs, error, match):
  arrays = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(N, K), (K, F), (F, K)]]
  with pytest.raises(error, match=r"mlp: " + match):
    _trace_local(lambda x, a, b: dense.mlp(x, a, b, axis_name="tp", **kwargs),
                 (P("tp"), P(None, "tp"), P("tp")), *arrays)


def test_injected_dot_general_runs_on_xla_collectives():
  """An injected dot_general is called, after lax.all_gather (column) and
  before lax.psum_scatter (row), and gives the plain layer's values."""
  calls = []

  def dot(*args, **kwargs):
    calls.append(kwargs)
    return jax.lax.dot_general(*args, **kwargs)

  x, kernel, fc2 = random_inputs(0, [(N, S, K), (K, F), (F, K)], jnp.float32)

  def layer(x, kernel, fc2):
    h = dense.column_parallel_dense(x, kernel, axis_name="tp", dot_general=dot)
    return dense.row_parallel_dense(h, fc2, axis_name="tp", dot_general=dot,
                                    precision=jax.lax.Precision.HIGHEST)

  f = jax.jit(jax.shard_map(layer, mesh=cpu_mesh(2), in_specs=(TOKENS, P(None, "tp"),
                                                               P("tp", None)),
                            out_specs=TOKENS))
  jaxpr = str(jax.make_jaxpr(f)(x, kernel, fc2))
  assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr
  assert [c["precision"] for c in calls] == [None, jax.lax.Precision.HIGHEST]
  want = (x @ kernel) @ fc2
  assert float(jnp.max(jnp.abs(f(x, kernel, fc2) - want))) < 1e-3
