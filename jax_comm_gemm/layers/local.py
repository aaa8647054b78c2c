"""Sequence-parallel dense layers on per-shard arrays, inside ``jax.shard_map``.

Between layers the activations are sharded along their first dimension (the
tokens; sequence parallelism). A column-parallel layer gathers the tokens and
splits the output features; a row-parallel layer splits the input features and
scatters the summed tokens. Further leading dimensions ride along:

=================  ======================  ==================  ===================
layer              input (local)           kernel (local)      output (local)
=================  ======================  ==================  ===================
column-parallel    ``[n/P, ..., K]``       ``[K, F/P]``        ``[n, ..., F/P]``
row-parallel       ``[n, ..., F/P]``       ``[F/P, K]``        ``[n/P, ..., K]``
=================  ======================  ==================  ===================

Each public function validates its arguments once, then runs the unchecked
core (``column_parallel`` / ``row_parallel``), which the global-array layers
(``sharded.py``) and the Flax modules call after their own validation. Biases
are added outside the custom_vjp, so autodiff sums their gradients (a
row-parallel bias is replicated over the axis), and must have the dtype of the
input (a float32 bias would silently turn a bfloat16 layer's output float32).

An injected ``dot_general`` (Flax's hook, e.g. its FP8 ops) cannot run inside
the fused kernels: the layer then runs on XLA's collectives around it,
``all_gather`` then ``dot_general`` (column), ``dot_general`` then
``psum_scatter`` (row).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_comm_gemm import validation
from jax_comm_gemm.collective_matmul import (all_gather_matmul_unchecked,
                                             matmul_reduce_scatter_unchecked)
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.layers.histories import mlp_histories
from jax_comm_gemm.layers.placement import Placement
from jax_comm_gemm.validation import Names


def column_parallel_dense(x, kernel, bias=None, *, axis_name: str,
                          keep_gathered_input: bool = False, precision=None,
                          config: CommGemmConfig = DEFAULT_CONFIG, dot_general=None):
  """``all_gather(x) @ kernel + bias`` (fc1, QKV), on local shards.

  Args:
    x: ``[n/P, ..., K]``, this shard's tokens.
    kernel: ``[K, F/P]``, this shard's output features.
    bias: ``[F/P]`` of x's dtype, or None.
    axis_name: the tensor-parallel mesh axis.
    keep_gathered_input: keep the gathered input for the weight gradient
      (no all-gather in the backward pass, ``n*K`` memory).
    precision: ``lax.Precision`` of the GEMMs that XLA runs.
    config: a :class:`~jax_comm_gemm.CommGemmConfig`.
    dot_general: None (the fused path where the backend has one), or a
      ``lax.dot_general``-like function run after XLA's ``all_gather``.

  Returns:
    ``[n, ..., F/P]``.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
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
  """``reduce_scatter(h @ kernel) + bias`` (fc2, out-proj), on local shards.

  Args:
    h: ``[n, ..., F/P]``, all tokens, this shard's features.
    kernel: ``[F/P, K]``, this shard's input features.
    bias: ``[K]`` (replicated) of h's dtype, or None.
    axis_name: the tensor-parallel mesh axis.
    precision: ``lax.Precision`` of the GEMMs that XLA runs.
    config: a :class:`~jax_comm_gemm.CommGemmConfig`.
    dot_general: None (the fused path where the backend has one), or a
      ``lax.dot_general``-like function run before XLA's ``psum_scatter``.

  Returns:
    ``[n/P, ..., K]``.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
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
  """A sequence-parallel MLP block, ``fc2(activation(fc1(x)))``, on local shards.

  ``x`` is ``[n/P, ..., K]``, ``fc1_kernel`` ``[K, F/P]``, ``fc2_kernel``
  ``[F/P, K]``; returns ``[n/P, ..., K]``. `fp8_histories`: for a "delayed"
  FP8 config, ``{"fc1": AmaxHistory, "fc2": AmaxHistory}``
  (:func:`~jax_comm_gemm.layers.histories.init_mlp_fp8_histories`); the
  gradient with respect to them is the next step's.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, a, b: mlp(x, a, b, axis_name="tp"), mesh=mesh,
  ...                   in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 8)), jnp.ones((8, 3))).shape
  (2, 3)
  """
  op = "mlp"
  histories = mlp_histories(op, config, fp8_histories)
  validation.bound_axis_size(op, axis_name)
  validation.check_callable(op, "activation", activation)
  options = checked_options(op, keep_gathered_input, precision, config, None)
  check_column(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel, fc1_bias)
  check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1], x)
  h = column_parallel(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                      fp8_history=histories["fc1"], **options)
  del options["keep_gathered_input"]
  return row_parallel(activation(h), fc2_kernel, fc2_bias, axis_name=axis_name,
                      fp8_history=histories["fc2"], **options)



def checked_options(op: str, keep_gathered_input, precision, config, dot_general) -> dict:
  """The layer options, checked: each error names its argument.

  >>> checked_options("f", False, None, DEFAULT_CONFIG, None)["keep_gathered_input"]
  False
  """
  validation.check_config(op, config)
  if dot_general is not None:
    validation.check_callable(op, "dot_general", dot_general)
  return dict(keep_gathered_input=validation.check_flag(op, "keep_gathered_input",
                                                        keep_gathered_input),
              precision=validation.check_precision(op, precision), config=config,
              dot_general=dot_general)


# --- checked entries on local shards (flax.common.run's local side) ---------------------

def column_local(names: Names, x, kernel, bias, *, where: Placement, **options):
  """A column-parallel call inside the caller's shard_map: checks, then runs.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, k: column_local(
  ...     Names("f"), x, k, None, where=Placement(True, "tp", 1), precision=None,
  ...     config=DEFAULT_CONFIG), mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
  ...     out_specs=P(None, "tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
  (2, 4)
  """
  check_column(names, x, kernel, bias)
  return column_parallel(x, kernel, bias, axis_name=where.axis_name, **options)


def row_local(names: Names, h, kernel, bias, *, where: Placement, **options):
  """A row-parallel call inside the caller's shard_map: checks, then runs.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda h, k: row_local(
  ...     Names("f"), h, k, None, where=Placement(True, "tp", 1), precision=None,
  ...     config=DEFAULT_CONFIG), mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
  ...     out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 4)), jnp.ones((4, 3))).shape
  (2, 3)
  """
  check_row(names, h, kernel, bias, where.axis_name, where.size)
  return row_parallel(h, kernel, bias, axis_name=where.axis_name, **options)


# --- the unchecked cores ------------------------------------------------------------

def column_parallel(x, kernel, bias, *, axis_name, keep_gathered_input=False,
                    precision=None, config=DEFAULT_CONFIG, dot_general=None,
                    dot_kwargs=(), fp8_history=None):
  """:func:`column_parallel_dense` for callers that validated the arguments;
  `dot_kwargs` are (name, value) pairs passed to an injected `dot_general`;
  `fp8_history` is a "delayed" FP8 recipe's AmaxHistory.

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, k: column_parallel(x, k, None, axis_name="tp"), mesh=mesh,
  ...                   in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
  (2, 4)
  """
  if dot_general is not None:
    gathered = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
    y = _injected(dot_general, gathered, kernel, precision, dot_kwargs)
  else:
    size = jax.lax.axis_size(axis_name)
    lead = np.shape(x)[:-1]
    y = all_gather_matmul_unchecked(x.reshape(-1, np.shape(x)[-1]), kernel, axis_name,
                                    transpose_w=False, return_gathered=False,
                                    keep_gathered_input=keep_gathered_input,
                                    precision=precision, config=config,
                                    fp8_history=fp8_history)
    y = y.reshape((lead[0] * size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + bias


def row_parallel(h, kernel, bias, *, axis_name, precision=None, config=DEFAULT_CONFIG,
                 dot_general=None, dot_kwargs=(), fp8_history=None):
  """:func:`row_parallel_dense` for callers that validated the arguments
  (`fp8_history` as in :func:`column_parallel`).

  >>> import jax.numpy as jnp; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda h, k: row_parallel(h, k, None, axis_name="tp"), mesh=mesh,
  ...                   in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 4)), jnp.ones((4, 3))).shape
  (2, 3)
  """
  if dot_general is not None:
    partial_sums = _injected(dot_general, h, kernel, precision, dot_kwargs)
    y = jax.lax.psum_scatter(partial_sums, axis_name, scatter_dimension=0, tiled=True)
  else:
    size = jax.lax.axis_size(axis_name)
    lead = np.shape(h)[:-1]
    y = matmul_reduce_scatter_unchecked(h.reshape(-1, np.shape(h)[-1]), kernel, axis_name,
                                        transpose_w=False, precision=precision,
                                        config=config, fp8_history=fp8_history)
    y = y.reshape((lead[0] // size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + bias


def _injected(dot_general, x, kernel, precision, dot_kwargs):
  """``x @ kernel`` over x's last dimension by an injected dot_general, called as
  Flax's Dense calls it."""
  return dot_general(x, kernel, (((np.ndim(x) - 1,), (0,)), ((), ())), precision=precision,
                     **dict(dot_kwargs))


# --- checks shared with sharded.py and the Flax modules ------------------------------

def check_column(names: Names, x, kernel, bias) -> None:
  """A local column-parallel call: x [n/P, ..., K], kernel [K, F/P], bias [F/P].

  >>> import jax.numpy as jnp
  >>> check_column(Names("f"), jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones(4))
  """
  validation.check_activations(names.op, names.x, x)
  _check_flat_matmul(names, x, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1], x)


def check_row(names: Names, h, kernel, bias, axis_name: str, size: int) -> None:
  """A local row-parallel call: h [n, ..., F/P], kernel [F/P, K], bias [K].

  >>> import jax.numpy as jnp
  >>> check_row(Names("f"), jnp.ones((2, 4)), jnp.ones((4, 3)), None, "tp", 2)
  """
  validation.check_activations(names.op, names.x, h)
  validation.check_tokens(names.op, names.x, np.shape(h), axis_name, size)
  _check_flat_matmul(names, h, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1], h)


def check_second_kernel(op: str, fc1_kernel, fc2_kernel, width: int) -> None:
  """fc2's kernel must map fc1's (local) outputs back to the model width.

  >>> import jax.numpy as jnp
  >>> check_second_kernel("f", jnp.ones((3, 8)), jnp.ones((8, 3)), 3)
  """
  want = (np.shape(fc1_kernel)[-1], width)
  if np.shape(fc2_kernel) != want:
    raise ValueError(f"{op}: `fc2_kernel` must have shape {want} (fc1_kernel "
                     f"transposed), got {np.shape(fc2_kernel)}")


def _check_flat_matmul(names: Names, x, kernel) -> None:
  flat = jax.ShapeDtypeStruct((int(np.prod(np.shape(x)[:-1])), np.shape(x)[-1]),
                              jax.numpy.result_type(x))
  validation.check_matmul(names.op, flat, kernel, transpose_w=False, x_name=names.x,
                          w_name=names.kernel)
