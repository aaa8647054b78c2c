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
