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
row-parallel bias is replicated over the axis).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_comm_gemm import validation
from jax_comm_gemm.collective_matmul import (all_gather_matmul_unchecked,
                                             matmul_reduce_scatter_unchecked)
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.validation import Names


def column_parallel_dense(x, kernel, bias=None, *, axis_name: str,
                          keep_gathered_input: bool = False, precision=None,
                          config: CommGemmConfig = DEFAULT_CONFIG):
  """``all_gather(x) @ kernel + bias`` (fc1, QKV), on local shards.

  Args:
    x: ``[n/P, ..., K]``, this shard's tokens.
    kernel: ``[K, F/P]``, this shard's output features.
    bias: ``[F/P]`` or None.
    axis_name: the tensor-parallel mesh axis.
    keep_gathered_input: keep the gathered input for the weight gradient
      (no all-gather in the backward pass, ``n*K`` memory).
    precision: ``lax.Precision`` of the GEMMs that XLA runs.

  Returns:
    ``[n, ..., F/P]``.
  """
  names = Names("column_parallel_dense")
  validation.bound_axis_size(names.op, axis_name)
  check_column(names, x, kernel, bias)
  return column_parallel(x, kernel, bias, axis_name=axis_name,
                         keep_gathered_input=keep_gathered_input, precision=precision,
                         config=config)


def row_parallel_dense(h, kernel, bias=None, *, axis_name: str, precision=None,
                       config: CommGemmConfig = DEFAULT_CONFIG):
  """``reduce_scatter(h @ kernel) + bias`` (fc2, out-proj), on local shards.

  Args:
    h: ``[n, ..., F/P]``, all tokens, this shard's features.
    kernel: ``[F/P, K]``, this shard's input features.
    bias: ``[K]`` (replicated) or None.
    axis_name: the tensor-parallel mesh axis.
    precision: ``lax.Precision`` of the GEMMs that XLA runs.

  Returns:
    ``[n/P, ..., K]``.
  """
  names = Names("row_parallel_dense", x="h")
  size = validation.bound_axis_size(names.op, axis_name)
  check_row(names, h, kernel, bias, axis_name, size)
  return row_parallel(h, kernel, bias, axis_name=axis_name, precision=precision,
                      config=config)


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *,
        axis_name: str, activation: Callable = jax.nn.gelu,
        keep_gathered_input: bool = False, precision=None,
        config: CommGemmConfig = DEFAULT_CONFIG):
  """A sequence-parallel MLP block, ``fc2(activation(fc1(x)))``, on local shards.

  ``x`` is ``[n/P, ..., K]``, ``fc1_kernel`` ``[K, F/P]``, ``fc2_kernel``
  ``[F/P, K]``; returns ``[n/P, ..., K]``.
  """
  op = "mlp"
  validation.bound_axis_size(op, axis_name)
  check_column(Names(op, kernel="fc1_kernel", bias="fc1_bias"), x, fc1_kernel, fc1_bias)
  check_second_kernel(op, fc1_kernel, fc2_kernel, np.shape(x)[-1])
  validation.check_bias(Names(op, bias="fc2_bias"), fc2_bias, np.shape(x)[-1])
  h = column_parallel(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                      keep_gathered_input=keep_gathered_input, precision=precision,
                      config=config)
  return row_parallel(activation(h), fc2_kernel, fc2_bias, axis_name=axis_name,
                      precision=precision, config=config)


# --- the unchecked cores ------------------------------------------------------------

def column_parallel(x, kernel, bias, *, axis_name, keep_gathered_input, precision, config):
  size = jax.lax.axis_size(axis_name)
  lead = np.shape(x)[:-1]
  y = all_gather_matmul_unchecked(x.reshape(-1, np.shape(x)[-1]), kernel, axis_name,
                                  transpose_w=False, return_gathered=False,
                                  keep_gathered_input=keep_gathered_input,
                                  precision=precision, config=config)
  y = y.reshape((lead[0] * size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + bias


def row_parallel(h, kernel, bias, *, axis_name, precision, config):
  size = jax.lax.axis_size(axis_name)
  lead = np.shape(h)[:-1]
  y = matmul_reduce_scatter_unchecked(h.reshape(-1, np.shape(h)[-1]), kernel, axis_name,
                                      transpose_w=False, precision=precision,
                                      config=config)
  y = y.reshape((lead[0] // size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + bias


# --- checks shared with sharded.py and the Flax modules ------------------------------

def check_column(names: Names, x, kernel, bias) -> None:
  """A local column-parallel call: x [n/P, ..., K], kernel [K, F/P], bias [F/P]."""
  validation.check_activations(names.op, names.x, x)
  _check_flat_matmul(names, x, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1])


def check_row(names: Names, h, kernel, bias, axis_name: str, size: int) -> None:
  """A local row-parallel call: h [n, ..., F/P], kernel [F/P, K], bias [K]."""
  validation.check_activations(names.op, names.x, h)
  validation.check_tokens(names.op, names.x, np.shape(h), axis_name, size)
  _check_flat_matmul(names, h, kernel)
  validation.check_bias(names, bias, np.shape(kernel)[-1])


def check_second_kernel(op: str, fc1_kernel, fc2_kernel, width: int) -> None:
  """fc2's kernel must map fc1's (local) outputs back to the model width."""
  want = (np.shape(fc1_kernel)[-1], width)
  if np.shape(fc2_kernel) != want:
    raise ValueError(f"{op}: `fc2_kernel` must have shape {want} (fc1_kernel "
                     f"transposed), got {np.shape(fc2_kernel)}")


def _check_flat_matmul(names: Names, x, kernel) -> None:
  flat = jax.ShapeDtypeStruct((int(np.prod(np.shape(x)[:-1])), np.shape(x)[-1]),
                              jax.numpy.result_type(x))
  validation.check_matmul(names.op, flat, kernel, transpose_w=False, x_name=names.x,
                          w_name=names.kernel)
