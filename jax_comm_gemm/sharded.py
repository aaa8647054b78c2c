"""The dense layers on global arrays: each wraps ``jax.shard_map`` over a mesh.

For use under ``jax.jit`` with ``NamedSharding`` (the Flax modules call these
when no shard_map is active). Tokens are the first dimension, sharded over
``data_axes`` (data parallelism, optional) and then ``axis_name``; kernels are
sharded over ``axis_name`` along their output (column-parallel) or input
(row-parallel) features.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import dense, validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig


def column_parallel_dense(x, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                          data_axes: Sequence[str] = (),
                          keep_gathered_input: bool = False,
                          config: CommGemmConfig = DEFAULT_CONFIG):
  """``x @ kernel + bias`` for global ``x [n, ..., K]`` sharded along tokens,
  ``kernel [K, F]`` sharded along F; returns ``[n, ..., F]`` sharded along F."""
  op = "sharded.column_parallel_dense"
  mesh, size, data = _mesh_axes(op, mesh, axis_name, data_axes)
  _check_tokens(op, "x", x, mesh, (*data, axis_name))
  _check_kernel(op, kernel, x, split=1, axis_name=axis_name, size=size)
  _check_placement(op, kernel, mesh, P(None, axis_name))
  lead = (None,) * (np.ndim(x) - 2)
  in_specs = [P((*data, axis_name), *lead, None), P(None, axis_name)]
  args = [x, kernel]
  if bias is not None:
    in_specs.append(P(axis_name))
    args.append(bias)

  def local(x, kernel, bias=None):
    return dense.column_parallel_dense(
        x, kernel, bias, axis_name=axis_name,
        keep_gathered_input=keep_gathered_input, config=config)

  out_spec = P(data or None, *lead, axis_name)
  return _shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                    out_specs=out_spec)(*args)


def row_parallel_dense(h, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                       data_axes: Sequence[str] = (),
                       config: CommGemmConfig = DEFAULT_CONFIG):
  """``h @ kernel + bias`` for global ``h [n, ..., F]`` sharded along F,
  ``kernel [F, K]`` sharded along F; returns ``[n, ..., K]`` sharded along tokens."""
  op = "sharded.row_parallel_dense"
  mesh, size, data = _mesh_axes(op, mesh, axis_name, data_axes)
  _check_tokens(op, "h", h, mesh, (*data, axis_name))
  _check_kernel(op, kernel, h, split=0, axis_name=axis_name, size=size)
  _check_placement(op, kernel, mesh, P(axis_name, None))
  lead = (None,) * (np.ndim(h) - 2)
  in_specs = [P(data or None, *lead, axis_name), P(axis_name, None)]
  args = [h, kernel]
  if bias is not None:
    in_specs.append(P(None))
    args.append(bias)

  def local(h, kernel, bias=None):
    return dense.row_parallel_dense(h, kernel, bias, axis_name=axis_name,
                                    config=config)

  return _shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                    out_specs=P((*data, axis_name), *lead, None))(*args)


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *, mesh=None,
        axis_name: str = "tp", data_axes: Sequence[str] = (),
        activation: Callable = jax.nn.gelu, keep_gathered_input: bool = False,
        config: CommGemmConfig = DEFAULT_CONFIG):
  """The sequence-parallel MLP block on global arrays: ``x [n, ..., K]`` in and
  out, sharded along tokens; ``fc1_kernel [K, F]``, ``fc2_kernel [F, K]``."""
  op = "sharded.mlp"
  mesh, size, data = _mesh_axes(op, mesh, axis_name, data_axes)
  _check_tokens(op, "x", x, mesh, (*data, axis_name))
  _check_kernel(op, fc1_kernel, x, split=1, axis_name=axis_name, size=size,
                name="fc1_kernel")
  if np.shape(fc2_kernel) != np.shape(fc1_kernel)[::-1]:
    raise ValueError(
        f"{op}: `fc2_kernel` must have shape {np.shape(fc1_kernel)[::-1]} "
        f"(fc1_kernel transposed), got {np.shape(fc2_kernel)}")
  _check_placement(op, fc1_kernel, mesh, P(None, axis_name), "fc1_kernel")
  _check_placement(op, fc2_kernel, mesh, P(axis_name, None), "fc2_kernel")
  lead = (None,) * (np.ndim(x) - 2)
  tokens = P((*data, axis_name), *lead, None)
  names = ["x", "fc1_kernel", "fc2_kernel"]
  in_specs = [tokens, P(None, axis_name), P(axis_name, None)]
  args = [x, fc1_kernel, fc2_kernel]
  for name, value, spec in (("fc1_bias", fc1_bias, P(axis_name)),
                            ("fc2_bias", fc2_bias, P(None))):
    if value is not None:
      names.append(name)
      in_specs.append(spec)
      args.append(value)

  def local(*values):
    kw = dict(zip(names, values))
    return dense.mlp(kw["x"], kw["fc1_kernel"], kw["fc2_kernel"],
                     kw.get("fc1_bias"), kw.get("fc2_bias"), axis_name=axis_name,
                     activation=activation,
                     keep_gathered_input=keep_gathered_input, config=config)

  return _shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                    out_specs=tokens)(*args)


def _shard_map(f, **kwargs):
  """``jax.shard_map`` under ``jax.jit``: called eagerly (``model.init(...)``
  outside jit), shard_map cannot run custom_vjp rules with symbolic zeros
  (NotImplementedError in jax 0.10). Under an outer jit the inner one inlines."""
  return jax.jit(jax.shard_map(f, **kwargs))


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


def _check_tokens(op, name, value, mesh, token_axes):
  if np.ndim(value) < 2:
    raise ValueError(
        f"{op}: `{name}` must have at least 2 dimensions [tokens, ..., "
        f"features], got shape {np.shape(value)}")
  shards = int(np.prod([mesh.shape[a] for a in token_axes]))
  validation.check_divisible(op, name, "tokens (first dimension)",
                             np.shape(value)[0], "*".join(token_axes), shards)


def _check_kernel(op, kernel, x, *, split, axis_name, size, name="kernel"):
  validation.check_rank(op, name, kernel, 2, "[in_features, out_features]")
  if np.shape(kernel)[0] != np.shape(x)[-1]:
    raise ValueError(
        f"{op}: inner dimensions differ: the input has {np.shape(x)[-1]} "
        f"features but `{name}` has {np.shape(kernel)[0]} input features "
        f"(shape {np.shape(kernel)})")
  which = "output" if split == 1 else "input"
  validation.check_divisible(op, name, f"{which} features", np.shape(kernel)[split],
                             axis_name, size)


def _check_placement(op, kernel, mesh, spec, name="kernel"):
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
