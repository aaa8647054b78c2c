"""The elementwise functions that an FP8 cast applies inside its own pass over
memory (:func:`jax_comm_gemm.fp8.cast.cast_transpose`'s `prologue`), so that
their output is never written in bf16: the MLP's activation, the activation
after fc1's bias, and the gradient through either (its backward).

A prologue takes one or more operands: tensors of x's shape ``[r, c]``, or
vectors ``[c]`` broadcast over the rows (a bias). Each function here is made
once per activation (cached), so that a kernel compiles once for it.

>>> import jax, jax.numpy as jnp
>>> f = with_bias(jax.nn.relu)
>>> f.__name__, activated((jnp.array([[1.0, -2.0]]), jnp.array([0.5, 1.0])), f).tolist()
('bias_relu', [[1.5, 0.0]])
"""

from __future__ import annotations

import functools

import jax

from jax_comm_gemm.fp8.quantize import F32


def activated(x, prologue):
  """``prologue(x)`` computed in float32 and rounded to x's dtype, as the op
  that writes an activation's output would round it; x itself without one.
  With x a tuple, ``prologue(*x)``, rounded to the first's dtype. The kernels
  compute it so too, tile by tile."""
  if prologue is None:
    return x
  xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  return prologue(*(a.astype(F32) for a in xs)).astype(xs[0].dtype)


@functools.cache
def with_bias(activation):
  """The prologue ``(h, b) -> activation(h + b)``: fc1's bias added inside fc2's
  cast, in float32, where the GEMM's epilogue could not take it (XLA adds a
  float32 master weight's bias in a pass of its own)."""
  def biased(h, b):
    return activation(h + b)
  biased.__name__ = "bias_" + getattr(activation, "__name__", "activation")
  return biased


@functools.cache
def activation_gradient(activation):
  """The prologue ``(dy, x, *rest) -> vjp(activation at (x, *rest))(dy)`` with
  respect to x: the gradient through an elementwise `activation` (through the
  bias too, as ``h + b``'s gradient is h's), made inside the cast of its
  result. The MLP's backward: fc1's output gradient is never written in bf16."""
  def gradient(dy, *xs):
    return jax.vjp(activation, *xs)[1](dy)[0]
  gradient.__name__ = "d" + getattr(activation, "__name__", "activation")
  return gradient
