"""The dense layers on global arrays: each wraps ``jax.shard_map`` over a mesh.

For use under ``jax.jit`` with ``NamedSharding`` (the Flax modules call these
when no shard_map is active). Tokens are the first dimension, sharded over
``data_axes`` (data parallelism, optional) and then ``axis_name``; kernels are
sharded over ``axis_name`` along their output (column-parallel) or input
(row-parallel) features. Each function validates the global arguments once and
runs the unchecked cores of ``local.py`` inside the shard_map. The shard_maps
are jitted functions of module scope with the options as static arguments, so
an eager call compiles once per shape and options, not once per call.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
import jax_comm_gemm.layers.local as local
from jax_comm_gemm.validation import Names

_STATIC = ("mesh", "axis_name", "data_axes", "precision", "config")


def column_parallel_dense(x, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                          data_axes: Sequence[str] = (), keep_gathered_input: bool = False,
                          precision=None, config: CommGemmConfig = DEFAULT_CONFIG,
                          names: Names | None = None):
  """``x @ kernel + bias`` for global ``x [n, ..., K]`` sharded along tokens,
  ``kernel [K, F]`` sharded along F; returns ``[n, ..., F]`` sharded along F.
  `names` (the Flax modules pass theirs) are what errors call things."""
  names = names or Names("sharded.column_parallel_dense")
  mesh, size, data = _mesh_axes(names.op, mesh, axis_name, data_axes)
  check_global_column(names, x, kernel, bias, mesh, axis_name, size, data)
  return _column(x, kernel, bias, mesh=mesh, axis_name=axis_name, data_axes=data,
                 keep_gathered_input=keep_gathered_input, precision=precision,
                 config=config)


def row_parallel_dense(h, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                       data_axes: Sequence[str] = (), precision=None,
                       config: CommGemmConfig = DEFAULT_CONFIG, names: Names | None = None):
  """``h @ kernel + bias`` for global ``h [n, ..., F]`` sharded along F,
  ``kernel [F, K]`` sharded along F; returns ``[n, ..., K]`` sharded along tokens."""
  names = names or Names("sharded.row_parallel_dense", x="h")
  mesh, size, data = _mesh_axes(names.op, mesh, axis_name, data_axes)
  check_global_row(names, h, kernel, bias, mesh, axis_name, size, data)
  return _row(h, kernel, bias, mesh=mesh, axis_name=axis_name, data_axes=data,
              precision=precision, config=config)


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *, mesh=None,
        axis_name: str = "tp", data_axes: Sequence[str] = (),
        activation: Callable = jax.nn.gelu, keep_gathered_input: bool = False,
        precision=None, config: CommGemmConfig = DEFAULT_CONFIG):
  """The sequence-parallel MLP block on global arrays: ``x [n, ..., K]`` in and
  out, sharded along tokens; ``fc1_kernel [K, F]``, ``fc2_kernel [F, K]``."""
  op = "sharded.mlp"
  mesh, size, data = _mesh_axes(op, mesh, axis_name, data_axes)
  check_global_column(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel,
                      fc1_bias, mesh, axis_name, size, data)
  local.check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1])
  _check_placement(op, fc2_kernel, mesh, P(axis_name, None), "fc2_kernel")
  return _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, mesh=mesh, axis_name=axis_name,
              data_axes=data, activation=activation,
              keep_gathered_input=keep_gathered_input, precision=precision, config=config)


# --- the jitted shard_maps ----------------------------------------------------------

def _specs(ndim, data, axis_name):
  lead = (None,) * (ndim - 2)
  return P((*data, axis_name), *lead, None), P(data or None, *lead, axis_name)


@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input"))
def _column(x, kernel, bias, *, mesh, axis_name, data_axes, keep_gathered_input, precision,
            config):
  tokens, features = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, kernel, bias):
    return local.column_parallel(x, kernel, bias, axis_name=axis_name,
                                 keep_gathered_input=keep_gathered_input,
                                 precision=precision, config=config)

  bias_spec = None if bias is None else P(axis_name)
  return jax.shard_map(body, mesh=mesh, in_specs=(tokens, P(None, axis_name), bias_spec),
                       out_specs=features)(x, kernel, bias)


@partial(jax.jit, static_argnames=_STATIC)
def _row(h, kernel, bias, *, mesh, axis_name, data_axes, precision, config):
  tokens, features = _specs(np.ndim(h), data_axes, axis_name)

  def body(h, kernel, bias):
    return local.row_parallel(h, kernel, bias, axis_name=axis_name, precision=precision,
                              config=config)

  bias_spec = None if bias is None else P(None)
  return jax.shard_map(body, mesh=mesh, in_specs=(features, P(axis_name, None), bias_spec),
                       out_specs=tokens)(h, kernel, bias)


@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input", "activation"))
def _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, *, mesh, axis_name, data_axes,
         activation, keep_gathered_input, precision, config):
  tokens, _ = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias):
    h = local.column_parallel(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                              keep_gathered_input=keep_gathered_input,
                              precision=precision, config=config)
    return local.row_parallel(activation(h), fc2_kernel, fc2_bias, axis_name=axis_name,
                              precision=precision, config=config)

  specs = (tokens, P(None, axis_name), P(axis_name, None),
           None if fc1_bias is None else P(axis_name), None if fc2_bias is None else P(None))
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(
      x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias)


# --- global checks --------------------------------------------------------------------

def check_global_column(names, x, kernel, bias, mesh, axis_name, size, data) -> None:
  """x [n, ..., K] sharded along tokens, kernel [K, F] split along F."""
  _check_global(names, x, kernel, bias, mesh, axis_name, size, data, split=1)


def check_global_row(names, h, kernel, bias, mesh, axis_name, size, data) -> None:
  """h [n, ..., F] split along F, kernel [F, K] split along F."""
  _check_global(names, h, kernel, bias, mesh, axis_name, size, data, split=0)


def _check_global(names, x, kernel, bias, mesh, axis_name, size, data, *, split) -> None:
  validation.check_activations(names.op, names.x, x)
  validation.check_tokens(names.op, names.x, np.shape(x), "*".join((*data, axis_name)),
                          _shards(mesh, (*data, axis_name)))
  _check_kernel(names, kernel, x, split=split, axis_name=axis_name, size=size)
  _check_dtypes(names, x, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[1])
  spec = P(None, axis_name) if split == 1 else P(axis_name, None)
  _check_placement(names.op, kernel, mesh, spec, names.kernel)


def resolve_mesh(op: str, mesh):
  """`mesh`, or the mesh set by ``jax.set_mesh``, or a clear error."""
  if mesh is not None:
    return mesh
  context = jax.sharding.get_abstract_mesh()
  if context.empty:
    raise ValueError(
        f"{op}: no mesh: pass mesh=jax.sharding.Mesh(...) or call under "
        "`with jax.set_mesh(mesh):`")
  return context


def _mesh_axes(op, mesh, axis_name, data_axes):
  mesh = resolve_mesh(op, mesh)
  size = validation.mesh_axis_size(op, mesh, axis_name)
  data = tuple(data_axes)
  for name in data:
    if name not in mesh.axis_names:
      raise ValueError(
          f"{op}: data_axes={data} names {name!r}, which is not an axis of "
          f"the mesh, whose axes are {tuple(mesh.axis_names)}")
  if axis_name in data:
    raise ValueError(
        f"{op}: data_axes={data} must not contain the tensor-parallel axis "
        f"{axis_name!r}")
  return mesh, size, data


def _shards(mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def _check_kernel(names, kernel, x, *, split, axis_name, size):
  validation.check_rank(names.op, names.kernel, kernel, 2, "[in_features, out_features]")
  if np.shape(kernel)[0] != np.shape(x)[-1]:
    raise ValueError(
        f"{names.op}: inner dimensions differ: the input has {np.shape(x)[-1]} "
        f"features but `{names.kernel}` has {np.shape(kernel)[0]} input features "
        f"(shape {np.shape(kernel)})")
  which = "output" if split == 1 else "input"
  validation.check_divisible(names.op, names.kernel, f"{which} features",
                             np.shape(kernel)[split], axis_name, size)


def _check_dtypes(names, x, kernel):
  validation.check_dtype(names.op, names.x, x)
  validation.check_dtype(names.op, names.kernel, kernel)
  if jax.numpy.result_type(x) != jax.numpy.result_type(kernel):
    raise TypeError(
        f"{names.op}: `{names.x}` ({jax.numpy.result_type(x)}) and `{names.kernel}` "
        f"({jax.numpy.result_type(kernel)}) must have the same dtype; cast one of them")


def _check_placement(op, kernel, mesh, spec, name):
  """A concrete kernel placed on this mesh must be sharded as the layer needs;
  shard_map would otherwise move it on every call."""
  if isinstance(kernel, jax.core.Tracer) or not isinstance(kernel, jax.Array):
    return
  sharding = kernel.sharding
  if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
    return
  if not sharding.is_equivalent_to(NamedSharding(mesh, spec), kernel.ndim):
    raise ValueError(
        f"{op}: `{name}` is sharded as {sharding.spec}, but this layer needs "
        f"{spec} (sharded along the {'output' if spec[1] else 'input'} "
        "features); reshard it with jax.device_put")
