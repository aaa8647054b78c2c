"""The sequence-parallel dense layers: where they run, their checks, and the
layers on local shards (inside the caller's ``jax.shard_map``) and on global
arrays (one jitted ``shard_map`` around the same cores).
Longer than 300 lines: the layer is one job, and both sides share its checks and cores.

=================  ======================  ==================  ===================
layer              input (local)           kernel (local)      output (local)
=================  ======================  ==================  ===================
column-parallel    ``[n/P, ..., K]``       ``[K, F/P]``        ``[n, ..., F/P]``
row-parallel       ``[n, ..., F/P]``       ``[F/P, K]``        ``[n/P, ..., K]``
=================  ======================  ==================  ===================

Biases are added outside the custom_vjp and must have the input's dtype. An
injected ``dot_general`` runs on XLA's collectives around it, without a
shard_map of its own (a Flax module passed as one stays in its scope)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import validation
from jax_comm_gemm.backends.routes import heads_inside
from jax_comm_gemm.collective_matmul import (all_gather_matmul_unchecked, fp8_mlp_unchecked,
                                             matmul_reduce_scatter_unchecked, scoped_activation)
from jax_comm_gemm.fp8.prologue import flat_operands, scoped
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig, check_config
from jax_comm_gemm.fp8 import AmaxHistory
from jax_comm_gemm.fp8 import heads as attention_layout
from jax_comm_gemm.runtime.registry import current_plan
from jax_comm_gemm.validation import Names

# --- where a call runs ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a call runs: inside the caller's ``jax.shard_map`` over `axis_name`
  (`local`, per-shard arrays) or on global arrays over `mesh`, with the
  axis's `size` and the checked `data_axes`.

  >>> Placement(local=True, axis_name="tp", size=2).shards
  2
  """
  local: bool
  axis_name: str
  size: int
  mesh: object = None
  data_axes: tuple[str, ...] = ()

  @property
  def shards(self) -> int:
    """How many shards the tokens split into (globally: data x tensor axes)."""
    if self.local or self.mesh is None:
      return self.size
    return int(np.prod([self.mesh.shape[a] for a in (*self.data_axes, self.axis_name)]))


def resolve_mesh(op: str, mesh):
  """`mesh`, or the mesh set by ``jax.set_mesh``, or a clear error.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> resolve_mesh("f", mesh) is mesh
  True
  """
  if mesh is not None:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
      raise TypeError(f"{op}: `mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")
    return mesh
  context = jax.sharding.get_abstract_mesh()
  if context.empty:
    raise ValueError(
        f"{op}: no mesh: pass mesh=jax.sharding.Mesh(...) or call under "
        "`with jax.set_mesh(mesh):`")
  return context


def _inside_shard_map(axis_name: str) -> bool:
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
  if manual is not None:
    return axis_name in manual
  try:  # a jax whose AbstractMesh lacks manual_axes
    jax.lax.axis_size(axis_name)
    return True
  except NameError:
    return False


def as_axes(op: str, axis_name, data_axes) -> tuple[str, ...]:
  """Checks the axis names' types; a str `data_axes` is one axis."""
  validation.check_axis_name(op, axis_name)
  if isinstance(data_axes, str):
    return (data_axes,)
  try:
    data = tuple(data_axes)
  except TypeError:
    data = None
  if data is None or not all(isinstance(a, str) for a in data):
    raise TypeError(
        f"{op}: data_axes must be a mesh axis name or a sequence of them, got {data_axes!r}")
  if axis_name in data:
    raise ValueError(f"{op}: data_axes={data} must not contain the tensor-parallel axis "
                     f"{axis_name!r}")
  if len(set(data)) != len(data):
    raise ValueError(f"{op}: data_axes={data} names an axis twice")
  return data


def check_mesh(op: str, mesh, axis_name: str, data_axes) -> tuple[int, tuple[str, ...]]:
  """(size of `axis_name`, data axes) of a global call on `mesh`, checked."""
  data = as_axes(op, axis_name, data_axes)
  size = validation.mesh_axis_size(op, mesh, axis_name)
  names = tuple(mesh.axis_names)
  for name in data:
    if name not in names:
      raise ValueError(f"{op}: data_axes={data} names {name!r}, which is not an axis of "
                       f"the mesh, whose axes are {names}")
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  missing = tuple(a for a in names if a != axis_name and a not in data and a not in manual
                  and mesh.shape[a] > 1)
  if missing:
    raise ValueError(
        f"{op}: data_axes={data} leaves out the mesh axes {missing} (sizes "
        f"{tuple(mesh.shape[a] for a in missing)}): the layer would replicate its work "
        f"over them. Pass data_axes={data + missing} to shard over them too, or call "
        "the layer inside a jax.shard_map over them to replicate on purpose")
  return size, data


def global_placement(op: str, mesh, axis_name, data_axes) -> Placement:
  """The placement of a call on global arrays over `mesh` (or ``jax.set_mesh``'s)."""
  mesh = resolve_mesh(op, mesh)
  size, data = check_mesh(op, mesh, axis_name, data_axes)
  return Placement(False, axis_name, size, mesh, data)


def place(op: str, mesh, axis_name, data_axes) -> Placement:
  """Local inside a ``jax.shard_map`` over `axis_name` (`mesh` and the data
  axes are then the caller's), else global on `mesh` or ``jax.set_mesh``'s."""
  data = as_axes(op, axis_name, data_axes)
  if _inside_shard_map(axis_name):
    return Placement(True, axis_name, int(jax.lax.axis_size(axis_name)), None, data)
  return global_placement(op, mesh, axis_name, data)


# --- the MLP's FP8 amax histories ("delayed" recipe) ---------------------------------------

MLP_LAYERS = ("fc1", "fc2")


def init_mlp_fp8_histories(config: CommGemmConfig):
  """The MLP's empty FP8 amax histories (``{"fc1": ..., "fc2": ...}``) where
  `config`'s recipe is "delayed", else None. Pass them as ``fp8_histories``;
  the MLP's gradient with respect to them is the next step's (replace, do not
  apply: :class:`~jax_comm_gemm.fp8.AmaxHistory`).

  >>> import jax_comm_gemm as jcg
  >>> init_mlp_fp8_histories(jcg.CommGemmConfig()) is None
  True
  """
  if config.fp8 is None or config.fp8.scaling != "delayed":
    return None
  return {name: AmaxHistory.zeros(config.fp8) for name in MLP_LAYERS}


def _mlp_histories(op: str, config, fp8_histories) -> dict:
  checked = validation.check_fp8_histories(op, config, fp8_histories, MLP_LAYERS,
                                           "init_mlp_fp8_histories(config)")
  return checked or dict.fromkeys(MLP_LAYERS)


# --- the public layers on local shards (jcg.column_parallel_dense, ...) -------------------

def column_parallel_dense(x, kernel, bias=None, *, axis_name: str,
                          keep_gathered_input: bool = False, precision=None,
                          config: CommGemmConfig = DEFAULT_CONFIG, dot_general=None):
  """``all_gather(x) @ kernel + bias`` (fc1, QKV), on local shards: x
  ``[n/P, ..., K]`` (this shard's tokens), kernel ``[K, F/P]``, bias ``[F/P]``
  of x's dtype or None; returns ``[n, ..., F/P]``. `keep_gathered_input`,
  `precision` and `config` as in :func:`jax_comm_gemm.all_gather_matmul`;
  `dot_general`: None (the fused path where the backend has one), or a
  ``lax.dot_general``-like function run after XLA's ``all_gather``.

  >>> import jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, k: column_parallel_dense(x, k, axis_name="tp"),
  ...                   mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
  (2, 4)
  """
  names = Names("column_parallel_dense")
  size = validation.bound_axis_size(names.op, axis_name)
  return column_local(names, x, kernel, bias, where=Placement(True, axis_name, size),
                      **checked_options(names.op, keep_gathered_input, precision, config,
                                        dot_general))


def row_parallel_dense(h, kernel, bias=None, *, axis_name: str, precision=None,
                       config: CommGemmConfig = DEFAULT_CONFIG, dot_general=None):
  """``reduce_scatter(h @ kernel) + bias`` (fc2, out-proj), on local shards: h
  ``[n, ..., F/P]`` (all tokens, this shard's features), kernel ``[F/P, K]``,
  bias ``[K]`` (replicated) or None; returns ``[n/P, ..., K]``. The options as in
  :func:`column_parallel_dense`; an injected `dot_general` runs before XLA's
  ``psum_scatter``.

  >>> import jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda h, k: row_parallel_dense(h, k, axis_name="tp"),
  ...                   mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 4)), jnp.ones((4, 3))).shape
  (2, 3)
  """
  names = Names("row_parallel_dense", x="h")
  size = validation.bound_axis_size(names.op, axis_name)
  options = checked_options(names.op, False, precision, config, dot_general)
  del options["keep_gathered_input"]
  return row_local(names, h, kernel, bias, where=Placement(True, axis_name, size), **options)


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *,
        axis_name: str, activation: Callable = jax.nn.gelu,
        keep_gathered_input: bool = False, precision=None,
        config: CommGemmConfig = DEFAULT_CONFIG, fp8_histories=None):
  """A sequence-parallel MLP block, ``fc2(activation(fc1(x)))``, on local shards:
  x ``[n/P, ..., K]``, fc1_kernel ``[K, F/P]``, fc2_kernel ``[F/P, K]``; returns
  ``[n/P, ..., K]``. `fp8_histories`: a "delayed" FP8 config's
  (:func:`init_mlp_fp8_histories`); their gradient is the next step's.

  >>> import jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, a, b: mlp(x, a, b, axis_name="tp"), mesh=mesh,
  ...                   in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 8)), jnp.ones((8, 3))).shape
  (2, 3)
  """
  op = "mlp"
  histories = _mlp_histories(op, config, fp8_histories)
  validation.bound_axis_size(op, axis_name)
  validation.check_callable(op, "activation", activation)
  options = checked_options(op, keep_gathered_input, precision, config, None)
  check_column(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel, fc1_bias)
  _check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1], x)
  return mlp_parallel(x, fc1_kernel, fc1_bias, fc2_kernel, fc2_bias, axis_name=axis_name,
                      activation=activation, fp8_histories=(histories["fc1"], histories["fc2"]),
                      plan=current_plan(), **options)


# --- the public layers on global arrays (jcg.sharded.*) -----------------------------------

def sharded_column_parallel_dense(x, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                                  data_axes: Sequence[str] = (),
                                  keep_gathered_input: bool = False, precision=None,
                                  config: CommGemmConfig = DEFAULT_CONFIG,
                                  names: Names | None = None, dot_general=None,
                                  fp8_history=None):
  """``jcg.sharded.column_parallel_dense``: ``x @ kernel + bias`` for global x
  ``[n, ..., K]`` sharded along tokens and kernel ``[K, F]`` along F; returns
  ``[n, ..., F]`` sharded along F. `names`: what errors call things;
  `fp8_history`: a "delayed" recipe's :class:`~jax_comm_gemm.fp8.AmaxHistory`.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> sharded_column_parallel_dense(np.ones((2, 3), np.float32),
  ...                               np.ones((3, 4), np.float32), mesh=mesh).shape
  (2, 4)
  """
  names = names or Names("sharded.column_parallel_dense")
  where = global_placement(names.op, mesh, axis_name, data_axes)
  return column_global(names, x, kernel, bias, where=where, fp8_history=fp8_history,
                       **checked_options(names.op, keep_gathered_input, precision, config,
                                         dot_general))


def sharded_row_parallel_dense(h, kernel, bias=None, *, mesh=None, axis_name: str = "tp",
                               data_axes: Sequence[str] = (), precision=None,
                               config: CommGemmConfig = DEFAULT_CONFIG,
                               names: Names | None = None, dot_general=None,
                               fp8_history=None):
  """``jcg.sharded.row_parallel_dense``: ``h @ kernel + bias`` for global h
  ``[n, ..., F]`` and kernel ``[F, K]``, both sharded along F; returns
  ``[n, ..., K]`` sharded along tokens.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> sharded_row_parallel_dense(np.ones((2, 4), np.float32),
  ...                            np.ones((4, 3), np.float32), mesh=mesh).shape
  (2, 3)
  """
  names = names or Names("sharded.row_parallel_dense", x="h")
  where = global_placement(names.op, mesh, axis_name, data_axes)
  options = checked_options(names.op, False, precision, config, dot_general)
  del options["keep_gathered_input"]
  return row_global(names, h, kernel, bias, where=where, fp8_history=fp8_history, **options)


def sharded_mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *, mesh=None,
                axis_name: str = "tp", data_axes: Sequence[str] = (),
                activation: Callable = jax.nn.gelu, keep_gathered_input: bool = False,
                precision=None, config: CommGemmConfig = DEFAULT_CONFIG,
                fp8_histories=None):
  """``jcg.sharded.mlp``: the sequence-parallel MLP block on global arrays, x
  ``[n, ..., K]`` in and out sharded along tokens, fc1_kernel ``[K, F]``,
  fc2_kernel ``[F, K]``; `fp8_histories` as in :func:`mlp`.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> sharded_mlp(np.ones((2, 3), np.float32), np.ones((3, 8), np.float32),
  ...             np.ones((8, 3), np.float32), mesh=mesh).shape
  (2, 3)
  """
  op = "sharded.mlp"
  histories = _mlp_histories(op, config, fp8_histories)
  where = global_placement(op, mesh, axis_name, data_axes)
  validation.check_callable(op, "activation", activation)
  options = checked_options(op, keep_gathered_input, precision, config, None)
  _check_global(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel, fc1_bias,
                where, split=1)
  _check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1], x)
  _check_placement(op, fc2_kernel, where.mesh, P(axis_name, None), "fc2_kernel")
  del options["dot_general"]
  return _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories, mesh=where.mesh,
              axis_name=axis_name, data_axes=where.data_axes, activation=activation,
              plan=current_plan(), **options)


def checked_options(op: str, keep_gathered_input, precision, config, dot_general) -> dict:
  """The layer options, checked: each error names its argument."""
  check_config(op, config)
  if dot_general is not None:
    validation.check_callable(op, "dot_general", dot_general)
  return dict(keep_gathered_input=validation.check_flag(op, "keep_gathered_input",
                                                        keep_gathered_input),
              precision=validation.check_precision(op, precision), config=config,
              dot_general=dot_general)


# --- the checked entries (flax.common.run calls these by name) ----------------------------

def column_local(names: Names, x, kernel, bias, *, where: Placement, **options):
  """A column-parallel call inside the caller's shard_map: checks, then runs."""
  check_column(names, x, kernel, bias)
  return column_parallel(x, kernel, bias, axis_name=where.axis_name, plan=current_plan(),
                         **options)


def row_local(names: Names, h, kernel, bias, *, where: Placement, **options):
  """A row-parallel call inside the caller's shard_map: checks, then runs."""
  check_row(names, h, kernel, bias, where.axis_name, where.size)
  return row_parallel(h, kernel, bias, axis_name=where.axis_name, plan=current_plan(),
                      **options)


def column_global(names: Names, x, kernel, bias, *, where: Placement, keep_gathered_input,
                  precision, config, dot_general=None, dot_kwargs=(), fp8_history=None):
  """A column-parallel call on global arrays: checks, then runs (the fused
  ops in one shard_map, or an injected `dot_general` on XLA's collectives)."""
  _check_global(names, x, kernel, bias, where, split=1)
  data, axis_name = where.data_axes, where.axis_name
  if dot_general is None:
    return _column(x, kernel, bias, fp8_history, mesh=where.mesh, axis_name=axis_name,
                   data_axes=data, keep_gathered_input=keep_gathered_input,
                   precision=precision, config=config, plan=current_plan())
  _, features = _specs(np.ndim(x), data, axis_name)
  gathered = _constrain(x, where.mesh, P(data or None))  # XLA's all-gather
  y = _constrain(_injected(dot_general, gathered, kernel, precision, dot_kwargs),
                 where.mesh, features)
  return y if bias is None else y + bias


def row_global(names: Names, h, kernel, bias, *, where: Placement, precision, config,
               dot_general=None, dot_kwargs=(), fp8_history=None):
  """A row-parallel call on global arrays: checks, then runs."""
  _check_global(names, h, kernel, bias, where, split=0)
  data, axis_name = where.data_axes, where.axis_name
  if dot_general is None:
    return _row(h, kernel, bias, fp8_history, mesh=where.mesh, axis_name=axis_name,
                data_axes=data, precision=precision, config=config, plan=current_plan())
  tokens, _ = _specs(np.ndim(h), data, axis_name)
  # The partial sums, then XLA's reduce-scatter onto the token shards.
  y = _constrain(_injected(dot_general, h, kernel, precision, dot_kwargs), where.mesh, tokens)
  return y if bias is None else y + bias


def _constrain(x, mesh, spec):
  sharding = NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
  return jax.lax.with_sharding_constraint(x, sharding)


# --- the unchecked cores, on local shards -------------------------------------------------

def column_parallel(x, kernel, bias, *, axis_name, keep_gathered_input=False,
                    precision=None, config=DEFAULT_CONFIG, dot_general=None,
                    dot_kwargs=(), fp8_history=None, prologue=None, split_heads=None,
                    plan):
  """:func:`column_parallel_dense` for callers that checked the arguments;
  `dot_kwargs`: (name, value) pairs for an injected `dot_general`. Of
  ``prologue(*x)`` where one is given, x the tuple of its operands
  (:mod:`jax_comm_gemm.fp8.prologue`: an FP8 recipe applies it inside x's cast).
  `split_heads` ``(parts, head_dim)``: the result as attention's arrays
  (:func:`jax_comm_gemm.fp8.heads.split_heads`, x ``[n/P, batch, K]``); under
  an FP8 recipe of one scale per tensor the op's backward casts their
  gradients where they lie (docs/fp8.md, "Attention's layout"). `plan`: the
  routing plan the layer's entry read (required: nothing below an entry reads it)."""
  if dot_general is not None:
    x = scoped(x, prologue)
    gathered = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
    y = _injected(dot_general, gathered, kernel, precision, dot_kwargs)
    y = y if bias is None else y + bias
  else:  # the op adds the bias
    xs, lead = flat_operands("column_parallel", x, prologue)
    inside = split_heads is not None and heads_inside(config, dot_general)
    y = all_gather_matmul_unchecked(xs if prologue else xs[0], kernel, axis_name,
                                    transpose_w=False, return_gathered=False,
                                    keep_gathered_input=keep_gathered_input,
                                    precision=precision, config=config,
                                    fp8_history=fp8_history, prologue=prologue,
                                    split_heads=(split_heads + (int(np.prod(lead[1:])),)
                                                 if inside else None), bias=bias, plan=plan)
    if inside:  # q, k and v already in attention's layout, the bias added
      return y
    y = y.reshape((lead[0] * jax.lax.axis_size(axis_name),) + lead[1:]
                  + (np.shape(kernel)[-1],))
  return y if split_heads is None else attention_layout.split_heads(y, *split_heads)


def row_parallel(h, kernel, bias, *, axis_name, precision=None, config=DEFAULT_CONFIG,
                 dot_general=None, dot_kwargs=(), fp8_history=None, activation=None,
                 merge_heads=False, plan):
  """:func:`row_parallel_dense` for callers that checked the arguments, of
  ``activation(h)`` where one is given (elementwise: an FP8 recipe applies it
  inside h's cast). `merge_heads`: h is attention's output ``[batch, n,
  heads, head_dim]`` (:func:`jax_comm_gemm.fp8.heads.merge_heads`; the result
  ``[n/P, batch, K]``), read where it lies under a per-tensor FP8 recipe;
  `plan` as in :func:`column_parallel`."""
  if merge_heads and heads_inside(config, dot_general):
    (batch, seq, n, head_dim), size = np.shape(h), jax.lax.axis_size(axis_name)
    y = matmul_reduce_scatter_unchecked(h.reshape(batch * seq, n * head_dim), kernel, axis_name,
                                        transpose_w=False, precision=precision, config=config,
                                        fp8_history=fp8_history, merge_heads=(head_dim, batch),
                                        plan=plan)
    y = y.reshape(seq // size, batch, -1)
    return y if bias is None else y + bias
  if merge_heads:
    h = attention_layout.merge_heads(h)
  if dot_general is not None:
    if activation is not None:
      h = scoped_activation(activation, h)
    partial_sums = _injected(dot_general, h, kernel, precision, dot_kwargs)
    y = jax.lax.psum_scatter(partial_sums, axis_name, scatter_dimension=0, tiled=True)
  else:
    lead = np.shape(h)[:-1]
    y = matmul_reduce_scatter_unchecked(h.reshape(-1, np.shape(h)[-1]), kernel, axis_name,
                                        transpose_w=False, precision=precision,
                                        config=config, fp8_history=fp8_history,
                                        activation=activation, plan=plan)
    y = y.reshape((lead[0] // jax.lax.axis_size(axis_name),) + lead[1:]
                  + (np.shape(kernel)[-1],))
  return y if bias is None else y + bias


def mlp_parallel(x, fc1_kernel, fc1_bias, fc2_kernel, fc2_bias, *, axis_name, activation,
                 keep_gathered_input=False, precision=None, config=DEFAULT_CONFIG,
                 dot_general=None, fp8_histories=(None, None), prologue=None, plan):
  """:func:`mlp` for callers that checked the arguments (`prologue` as in
  :func:`column_parallel`): under an FP8 recipe one op for both layers (the
  gradient through the activation, and fc1's bias's, made inside fc1's
  gradient cast); else column_parallel, then row_parallel with the activation.
  `plan` as in :func:`column_parallel`."""
  if dot_general is not None or config.fp8 is None:
    h = column_parallel(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                        keep_gathered_input=keep_gathered_input, precision=precision,
                        config=config, dot_general=dot_general, fp8_history=fp8_histories[0],
                        prologue=prologue, plan=plan)
    return row_parallel(h, fc2_kernel, fc2_bias, axis_name=axis_name, precision=precision,
                        config=config, dot_general=dot_general, fp8_history=fp8_histories[1],
                        activation=activation, plan=plan)
  xs, lead = flat_operands("mlp", x, prologue)
  y = fp8_mlp_unchecked(xs if prologue else xs[0], fc1_kernel, fc1_bias, fc2_kernel,
                        axis_name, activation=activation,
                        keep_gathered_input=keep_gathered_input, precision=precision,
                        config=config, fp8_histories=fp8_histories, prologue=prologue,
                        plan=plan)
  y = y.reshape(lead + (np.shape(fc2_kernel)[-1],))
  return y if fc2_bias is None else y + fc2_bias


def _injected(dot_general, x, kernel, precision, dot_kwargs):
  """``x @ kernel`` by an injected dot_general, called as Flax's Dense calls it."""
  return dot_general(x, kernel, (((np.ndim(x) - 1,), (0,)), ((), ())), precision=precision,
                     **dict(dot_kwargs))


# --- the jitted shard_maps of the global layers -------------------------------------------
# The routing plan in force is a static argument too, read once at the entry and
# passed down to every route: a trace under an older plan (before connect or
# autotune) is never reused under a newer one. An FP8 amax
# history (a "delayed" recipe's) is one array for every shard: P().

_STATIC = ("mesh", "axis_name", "data_axes", "precision", "config", "plan")


def _specs(ndim, data, axis_name):
  lead = (None,) * (ndim - 2)
  return P((*data, axis_name), *lead, None), P(data or None, *lead, axis_name)


@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input"))
def _column(x, kernel, bias, history, *, mesh, axis_name, data_axes, keep_gathered_input,
            precision, config, plan):
  tokens, features = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, kernel, bias, history):
    return column_parallel(x, kernel, bias, axis_name=axis_name,
                           keep_gathered_input=keep_gathered_input, precision=precision,
                           config=config, fp8_history=history, plan=plan)

  specs = (tokens, P(None, axis_name), None if bias is None else P(axis_name),
           None if history is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=features)(
      x, kernel, bias, history)


@partial(jax.jit, static_argnames=_STATIC)
def _row(h, kernel, bias, history, *, mesh, axis_name, data_axes, precision, config, plan):
  tokens, features = _specs(np.ndim(h), data_axes, axis_name)

  def body(h, kernel, bias, history):
    return row_parallel(h, kernel, bias, axis_name=axis_name, precision=precision,
                        config=config, fp8_history=history, plan=plan)

  specs = (features, P(axis_name, None), None if bias is None else P(None),
           None if history is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(
      h, kernel, bias, history)


@partial(jax.jit, static_argnames=(*_STATIC, "keep_gathered_input", "activation"))
def _mlp(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories, *, mesh, axis_name,
         data_axes, activation, keep_gathered_input, precision, config, plan):
  tokens, _ = _specs(np.ndim(x), data_axes, axis_name)

  def body(x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories):
    return mlp_parallel(x, fc1_kernel, fc1_bias, fc2_kernel, fc2_bias, axis_name=axis_name,
                        activation=activation, keep_gathered_input=keep_gathered_input,
                        precision=precision, config=config,
                        fp8_histories=(histories["fc1"], histories["fc2"]), plan=plan)

  specs = (tokens, P(None, axis_name), P(axis_name, None),
           None if fc1_bias is None else P(axis_name), None if fc2_bias is None else P(None),
           P())  # the histories: replicated (Nones without a "delayed" recipe)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(
      x, fc1_kernel, fc2_kernel, fc1_bias, fc2_bias, histories)


# --- the checks -------------------------------------------------------------------------

def check_column(names: Names, x, kernel, bias) -> None:
  """A local column-parallel call: x [n/P, ..., K], kernel [K, F/P], bias [F/P]."""
  validation.check_activations(names.op, names.x, x)
  _check_flat_matmul(names, x, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1], x)


def check_row(names: Names, h, kernel, bias, axis_name: str, size: int) -> None:
  """A local row-parallel call: h [n, ..., F/P], kernel [F/P, K], bias [K]."""
  validation.check_activations(names.op, names.x, h)
  validation.check_tokens(names.op, names.x, np.shape(h), axis_name, size)
  _check_flat_matmul(names, h, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1], h)


def _check_second_kernel(op: str, fc1_kernel, fc2_kernel, width: int) -> None:
  want = (np.shape(fc1_kernel)[-1], width)
  if np.shape(fc2_kernel) != want:
    raise ValueError(f"{op}: `fc2_kernel` must have shape {want} (fc1_kernel "
                     f"transposed), got {np.shape(fc2_kernel)}")


def _check_flat_matmul(names: Names, x, kernel) -> None:
  flat = jax.ShapeDtypeStruct((int(np.prod(np.shape(x)[:-1])), np.shape(x)[-1]),
                              jax.numpy.result_type(x))
  validation.check_matmul(names.op, flat, kernel, transpose_w=False, x_name=names.x,
                          w_name=names.kernel)


def _check_global(names, x, kernel, bias, where: Placement, *, split) -> None:
  """Global x [n, ..., K] sharded along tokens, kernel [K, F] split along F
  (`split` 1: column-parallel) or along K (0: row-parallel)."""
  axis_name = where.axis_name
  validation.check_activations(names.op, names.x, x)
  validation.check_tokens(names.op, names.x, np.shape(x),
                          "*".join((*where.data_axes, axis_name)), where.shards)
  validation.check_rank(names.op, names.kernel, kernel, 2, "[in_features, out_features]")
  validation.check_inner(names.op, "the input", np.shape(x)[-1], f"`{names.kernel}`",
                         np.shape(kernel)[0], np.shape(kernel))
  validation.check_divisible(names.op, names.kernel,
                             f"{'output' if split == 1 else 'input'} features",
                             np.shape(kernel)[split], axis_name, where.size)
  validation.check_same_dtype(names.op, names.x, x, names.kernel, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[1], x)
  spec = P(None, axis_name) if split == 1 else P(axis_name, None)
  _check_placement(names.op, kernel, where.mesh, spec, names.kernel)


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
