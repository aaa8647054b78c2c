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

Biases are added outside the custom_vjp, so autodiff sums their gradients
(a row-parallel bias is replicated over the axis).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_comm_gemm import validation
from jax_comm_gemm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig


def column_parallel_dense(x, kernel, bias=None, *, axis_name: str,
                          keep_gathered_input: bool = False,
                          config: CommGemmConfig = DEFAULT_CONFIG):
  """``all_gather(x) @ kernel + bias`` (fc1, QKV), on local shards.

  Args:
    x: ``[n/P, ..., K]``, this shard's tokens.
    kernel: ``[K, F/P]``, this shard's output features.
    bias: ``[F/P]`` or None.
    axis_name: the tensor-parallel mesh axis.
    keep_gathered_input: keep the gathered input for the weight gradient
      (no all-gather in the backward pass, ``n*K`` memory).

  Returns:
    ``[n, ..., F/P]``.
  """
  op = "column_parallel_dense"
  size = validation.bound_axis_size(op, axis_name)
  _check_activations(op, "x", x)
  lead = np.shape(x)[:-1]
  y = all_gather_matmul(x.reshape(-1, np.shape(x)[-1]), kernel, axis_name,
                        keep_gathered_input=keep_gathered_input, config=config)
  y = y.reshape((lead[0] * size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + _checked_bias(op, bias, np.shape(kernel)[-1])


def row_parallel_dense(h, kernel, bias=None, *, axis_name: str,
                       config: CommGemmConfig = DEFAULT_CONFIG):
  """``reduce_scatter(h @ kernel) + bias`` (fc2, out-proj), on local shards.

  Args:
    h: ``[n, ..., F/P]``, all tokens, this shard's features.
    kernel: ``[F/P, K]``, this shard's input features.
    bias: ``[K]`` (replicated) or None.
    axis_name: the tensor-parallel mesh axis.

  Returns:
    ``[n/P, ..., K]``.
  """
  op = "row_parallel_dense"
  size = validation.bound_axis_size(op, axis_name)
  _check_activations(op, "h", h)
  lead = np.shape(h)[:-1]
  validation.check_divisible(op, "h", "tokens (first dimension)", lead[0],
                             axis_name, size)
  y = matmul_reduce_scatter(h.reshape(-1, np.shape(h)[-1]), kernel, axis_name,
                            config=config)
  y = y.reshape((lead[0] // size,) + lead[1:] + (np.shape(kernel)[-1],))
  return y if bias is None else y + _checked_bias(op, bias, np.shape(kernel)[-1])


def mlp(x, fc1_kernel, fc2_kernel, fc1_bias=None, fc2_bias=None, *,
        axis_name: str, activation: Callable = jax.nn.gelu,
        keep_gathered_input: bool = False,
        config: CommGemmConfig = DEFAULT_CONFIG):
  """A sequence-parallel MLP block, ``fc2(activation(fc1(x)))``, on local shards.

  ``x`` is ``[n/P, ..., K]``, ``fc1_kernel`` ``[K, F/P]``, ``fc2_kernel``
  ``[F/P, K]``; returns ``[n/P, ..., K]``.
  """
  h = column_parallel_dense(x, fc1_kernel, fc1_bias, axis_name=axis_name,
                            keep_gathered_input=keep_gathered_input, config=config)
  return row_parallel_dense(activation(h), fc2_kernel, fc2_bias,
                            axis_name=axis_name, config=config)


def _check_activations(op: str, name: str, value) -> None:
  if np.ndim(value) < 2:
    raise ValueError(
        f"{op}: `{name}` must have at least 2 dimensions [tokens, ..., "
        f"features], got shape {np.shape(value)}")


def _checked_bias(op: str, bias, features: int):
  if np.shape(bias) != (features,):
    raise ValueError(
        f"{op}: `bias` must have shape ({features},) to match the kernel's "
        f"output features, got {np.shape(bias)}")
  return bias
