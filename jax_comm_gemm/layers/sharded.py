"""The dense layers on global arrays: each wraps ``jax.shard_map`` over a mesh.

For use under ``jax.jit`` with ``NamedSharding`` (the Flax modules call these
when no shard_map is active). Tokens are the first dimension, sharded over
``data_axes`` (data parallelism, optional) and then ``axis_name``; kernels are
sharded over ``axis_name`` along their output (column-parallel) or input
(row-parallel) features. Each function validates the global arguments once and
runs the unchecked cores of ``local.py`` inside the shard_map. The shard_maps
are jitted functions of module scope with the options as static arguments, so
an eager call compiles once per shape and options, not once per call.

``data_axes`` is a mesh axis name or a sequence of them; every mesh axis of
size > 1 other than ``axis_name`` must be among them (see
:mod:`~jax_comm_gemm.layers.placement`). A bias must have the input's dtype.
With an injected ``dot_general`` the layer runs without shard_map, on XLA's
collectives (sharding constraints around the injected call), so that a Flax
module passed as the dot_general (Flax's FP8 ops) stays in its scope.
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
from jax_comm_gemm.layers.histories import mlp_histories
from jax_comm_gemm.layers.placement import Placement, global_placement, resolve_mesh
from jax_comm_gemm.runtime.registry import current_plan
from jax_comm_gemm.validation import Names

__all__ = ["column_parallel_dense", "mlp", "resolve_mesh", "row_parallel_dense"]

# The routing plan in force is static too: a trace under an older plan (before
# connect or autotune) is never reused for a call under a newer one.
_STATIC = ("mesh", "axis_name", "data_axes", "precision", "config", "plan")


def column_parallel_dense(x, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                          data_axes: Sequence[str] = (), keep_gathered_input: bool = False,
                          precision=None, config: CommGemmConfig = DEFAULT_CONFIG,
                          names: Names | None = None, dot_general=None, fp8_history=None):
  """``x @ kernel + bias`` for global ``x [n, ..., K]`` sharded along tokens,
  ``kernel [K, F]`` sharded along F; returns ``[n, ..., F]`` sharded along F.
  `names` (the Flax modules pass theirs) are what errors call things;
  `fp8_history`: a "delayed" FP8 recipe's :class:`~jax_comm_gemm.fp8.AmaxHistory`
  (its gradient is the next one).

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> column_parallel_dense(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
  ...                       mesh=mesh).shape
  (2, 4)
  """
  names = names or Names("sharded.column_parallel_dense")
  where = global_placement(names.op, mesh, axis_name, data_axes)
  return column_global(names, x, kernel, bias, where=where, fp8_history=fp8_history,
                       **local.checked_options(names.op, keep_gathered_input, precision,
                                               config, dot_general))


def row_parallel_dense(h, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                       data_axes: Sequence[str] = (), precision=None,
                       config: CommGemmConfig = DEFAULT_CONFIG, names: Names | None = None,
                       dot_general=None, fp8_history=None):
  """``h @ kernel + bias`` for global ``h [n, ..., F]`` sharded along F,
  ``kernel [F, K]`` sharded along F; returns ``[n, ..., K]`` sharded along tokens
  (`fp8_history` as in :func:`column_parallel_dense`).

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> row_parallel_dense(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32),
  ...                    mesh=mesh).shape
  (2, 3)
  """
  names = names or Names("sharded.row_parallel_dense", x="h")
  where = global_placement(names.op, mesh, axis_name, data_axes)
  options = local.checked_options(names.op, False, precision, config, dot_general)
  del options["keep_gathered_input"]
  return row_global(names, h, kernel, bias, where=where, fp8_history=fp8_history, **options)


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *, mesh=None,
        axis_name: str = "tp", data_axes: Sequence[str] = (),
        activation: Callable = jax.nn.gelu, keep_gathered_input: bool = False,
        precision=None, config: CommGemmConfig = DEFAULT_CONFIG, fp8_histories=None):
  """The sequence-parallel MLP block on global arrays: ``x [n, ..., K]`` in and
  out, sharded along tokens; ``fc1_kernel [K, F]``, ``fc2_kernel [F, K]``;
  `fp8_histories` as in :func:`jax_comm_gemm.layers.local.mlp`.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> mlp(np.ones((2, 3), np.float32), np.ones((3, 8), np.float32),
  ...     np.ones((8, 3), np.float32), mesh=mesh).shape
  (2, 3)
  """
  op = "sharded.mlp"
  histories = mlp_histories(op, config, fp8_histories)
  where = global_placement(op, mesh, axis_name, data_axes)
  validation.check_callable(op, "activation", activation)
  options = local.checked_options(op, keep_gathered_input, precision, config, None)
  check_global_column(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel,
                      fc1_bias, where)
  local.check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1], x)
  _check_placement(op, fc2_kernel, where.mesh, P(axis_name, None), "fc2_kernel")
  del options["dot_general"]
  return _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories, mesh=where.mesh,
              axis_name=axis_name, data_axes=where.data_axes, activation=activation,
              plan=current_plan(), **options)


# --- checked entries on global arrays (flax.common.run's global side) -------------------

def column_global(names: Names, x, kernel, bias, *, where: Placement, keep_gathered_input,
                  precision, config, dot_general=None, dot_kwargs=(), fp8_history=None):
  """A column-parallel call on global arrays: checks, then runs (the fused
  ops in one shard_map, or an injected `dot_general` on XLA's collectives).

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> column_global(Names("f"), np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
  ...               None, where=Placement(False, "tp", 1, mesh), keep_gathered_input=False,
  ...               precision=None, config=DEFAULT_CONFIG).shape
  (2, 4)
  """
  check_global_column(names, x, kernel, bias, where)
  data, axis_name = where.data_axes, where.axis_name
  if dot_general is None:
    return _column(x, kernel, bias, fp8_history, mesh=where.mesh, axis_name=axis_name,
                   data_axes=data, keep_gathered_input=keep_gathered_input,
                   precision=precision, config=config, plan=current_plan())
  _, features = _specs(np.ndim(x), data, axis_name)
  gathered = _constrain(x, where.mesh, P(data or None))  # XLA's all-gather
  y = _constrain(local._injected(dot_general, gathered, kernel, precision, dot_kwargs),
                 where.mesh, features)
  return y if bias is None else y + bias


def row_global(names: Names, h, kernel, bias, *, where: Placement, precision, config,
               dot_general=None, dot_kwargs=(), fp8_history=None):
  """A row-parallel call on global arrays: checks, then runs.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> row_global(Names("f"), np.ones((2, 4), np.float32), np.ones((4, 3), np.float32),
  ...            None, where=Placement(False, "tp", 1, mesh), precision=None,
  ...            config=DEFAULT_CONFIG).shape
  (2, 3)
  """
  check_global_row(names, h, kernel, bias, where)
  data, axis_name = where.data_axes, where.axis_name
  if dot_general is None:
    return _row(h, kernel, bias, fp8_history, mesh=where.mesh, axis_name=axis_name,
                data_axes=data, precision=precision, config=config, plan=current_plan())
  tokens, _ = _specs(np.ndim(h), data, axis_name)
  # The partial sums, then XLA's reduce-scatter onto the token shards.
  y = _constrain(local._injected(dot_general, h, kernel, precision, dot_kwargs),
                 where.mesh, tokens)
  return y if bias is None else y + bias


def _constrain(x, mesh, spec):
  sharding = (jax.sharding.NamedSharding(mesh, spec)
              if isinstance(mesh, jax.sharding.Mesh) else spec)
  return jax.lax.with_sharding_constraint(x, sharding)


# --- the jitted shard_maps ----------------------------------------------------------

def _specs(ndim, data, axis_name):
  lead = (None,) * (ndim - 2)
  return P((*data, axis_name), *lead, None), P(data or None, *lead, axis_name)


# An FP8 amax history (a "delayed" recipe's) is one array for every shard: P().

@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input"))
def _column(x, kernel, bias, history, *, mesh, axis_name, data_axes, keep_gathered_input,
            precision, config, plan):
  tokens, features = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, kernel, bias, history):
    return local.column_parallel(x, kernel, bias, axis_name=axis_name,
                                 keep_gathered_input=keep_gathered_input,
                                 precision=precision, config=config, fp8_history=history)

  specs = (tokens, P(None, axis_name), None if bias is None else P(axis_name),
           None if history is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=features)(
      x, kernel, bias, history)


@partial(jax.jit, static_argnames=_STATIC)
def _row(h, kernel, bias, history, *, mesh, axis_name, data_axes, precision, config, plan):
  tokens, features = _specs(np.ndim(h), data_axes, axis_name)

  def body(h, kernel, bias, history):
    return local.row_parallel(h, kernel, bias, axis_name=axis_name, precision=precision,
                              config=config, fp8_history=history)

  specs = (features, P(axis_name, None), None if bias is None else P(None),
           None if history is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(
      h, kernel, bias, history)


@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input", "activation"))
def _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories, *, mesh, axis_name,
         data_axes, activation, keep_gathered_input, precision, config, plan):
  tokens, _ = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories):
    h = local.column_parallel(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                              keep_gathered_input=keep_gathered_input,
                              precision=precision, config=config,
                              fp8_history=histories["fc1"])
    return local.row_parallel(activation(h), fc2_kernel, fc2_bias, axis_name=axis_name,
                              precision=precision, config=config,
                              fp8_history=histories["fc2"])

  specs = (tokens, P(None, axis_name), P(axis_name, None),
           None if fc1_bias is None else P(axis_name), None if fc2_bias is None else P(None),
           P())  # the histories: replicated (Nones without a "delayed" recipe)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(
      x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories)


# --- global checks --------------------------------------------------------------------

def check_global_column(names, x, kernel, bias, where: Placement) -> None:
  """x [n, ..., K] sharded along tokens, kernel [K, F] split along F.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> check_global_column(Names("f"), np.ones((2, 3), np.float32),
  ...                     np.ones((3, 4), np.float32), None, Placement(False, "tp", 1, mesh))
  """
  _check_global(names, x, kernel, bias, where, split=1)


def check_global_row(names, h, kernel, bias, where: Placement) -> None:
  """h [n, ..., F] split along F, kernel [F, K] split along F.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> check_global_row(Names("f"), np.ones((2, 4), np.float32),
  ...                  np.ones((4, 3), np.float32), None, Placement(False, "tp", 1, mesh))
  """
  _check_global(names, h, kernel, bias, where, split=0)


def _check_global(names, x, kernel, bias, where: Placement, *, split) -> None:
  axis_name = where.axis_name
  validation.check_activations(names.op, names.x, x)
  validation.check_tokens(names.op, names.x, np.shape(x),
                          "*".join((*where.data_axes, axis_name)), where.shards)
  _check_kernel(names, kernel, x, split=split, axis_name=axis_name, size=where.size)
  validation.check_same_dtype(names.op, names.x, x, names.kernel, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[1], x)
  spec = P(None, axis_name) if split == 1 else P(axis_name, None)
  _check_placement(names.op, kernel, where.mesh, spec, names.kernel)


def _check_kernel(names, kernel, x, *, split, axis_name, size):
  validation.check_rank(names.op, names.kernel, kernel, 2, "[in_features, out_features]")
  validation.check_inner(names.op, "the input", np.shape(x)[-1], f"`{names.kernel}`",
                         np.shape(kernel)[0], np.shape(kernel))
  which = "output" if split == 1 else "input"
  validation.check_divisible(names.op, names.kernel, f"{which} features",
                             np.shape(kernel)[split], axis_name, size)


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
