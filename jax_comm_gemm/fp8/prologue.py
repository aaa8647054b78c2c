"""The elementwise functions that an FP8 cast applies inside its own pass over
memory (:func:`jax_comm_gemm.fp8.cast.cast_transpose`'s `prologue`), so that
their output is never written in bf16: a LayerNorm's or an RMSNorm's
normalization from its row statistics, the MLP's activation, the activation after fc1's bias, and
the gradient through either (its backward).

A prologue takes one or more operands: tensors of x's shape ``[r, c]``,
vectors ``[c]`` broadcast over the rows (a bias), or columns ``[r, 1]``
broadcast over the columns (a row's statistic). Each function here is made
once per activation (cached), so that a kernel compiles once for it.

>>> import jax, jax.numpy as jnp
>>> f = with_bias(jax.nn.relu)
>>> f.__name__, activated((jnp.array([[1.0, -2.0]]), jnp.array([0.5, 1.0])), f).tolist()
('bias_relu', [[1.5, 0.0]])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_comm_gemm import validation
from jax_comm_gemm.fp8.quantize import F32


def activated(x, prologue):
  """``prologue(x)`` computed in float32 (float64 for float64 x) and rounded to
  x's dtype, as the op that writes an activation's output would round it; x
  itself without one. With x a tuple, ``prologue(*x)``, rounded to the
  first's dtype. The kernels compute it so too, tile by tile."""
  if prologue is None:
    return x
  xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  dtype = jnp.promote_types(xs[0].dtype, F32)
  return prologue(*(jnp.asarray(a, dtype) for a in xs)).astype(xs[0].dtype)


def _scope(prologue):
  """The name scope of a prologue's own passes: a profile tells a "layer_norm"
  pass by it."""
  return jax.named_scope(getattr(prologue, "__name__", "prologue"))


def scoped(x, prologue):
  """:func:`activated` under the prologue's name as a scope, where no FP8 cast
  applies it."""
  if prologue is None:
    return x
  with _scope(prologue):
    return activated(x, prologue)


def gradients(operands, prologue, dy):
  """The gradients of a prologue's `operands` (a tuple), each in its dtype,
  through :func:`activated` with the output's gradient `dy`, under the
  prologue's scope: the backward of an op that applied `prologue` inside its
  cast (XLA fuses the recomputation)."""
  with _scope(prologue):
    return jax.vjp(lambda *xs: activated(xs, prologue), *operands)[1](dy)


def layer_norm(x, mean, rstd, scale, bias):
  """A LayerNorm's normalization from its row statistics, ``(x - mean) *
  (rstd * scale) + bias``: mean and rstd ``[r, 1]``, scale and bias ``[c]``
  (:func:`jax_comm_gemm.layers.transformer.layer_norm`, inside the cast of the
  GEMM input it feeds)."""
  return (x - mean) * (rstd * scale) + bias


def rms_norm(x, rstd, scale):
  """An RMSNorm's normalization from its row statistic, ``x * (rstd * scale)``:
  rstd ``[r, 1]``, scale ``[c]`` (:func:`jax_comm_gemm.layers.llama.rms_norm`,
  inside the cast of the GEMM input it feeds, as :func:`layer_norm` is)."""
  return x * (rstd * scale)


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


def operands(op: str, x, prologue, *, two_d: bool = False) -> tuple:
  """x as a tuple, checked: one array ``[n, ..., k]`` (2-D where `two_d`), or
  with a `prologue` its operands, x first, each of x's shape, a vector ``[k]``
  or a column ``[n, ..., 1]``. The one rule of the ops and of the kernels."""
  xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  if prologue is not None:
    validation.check_callable(op, "prologue", prologue)
  elif len(xs) > 1:
    raise ValueError(f"{op}: `x` may be a tuple only as the operands of a `prologue`, "
                     f"got {len(xs)} arrays and no prologue")
  shape = jnp.shape(xs[0])
  allowed = (shape, shape[-1:], shape[:-1] + (1,))
  if (len(shape) != 2 if two_d else len(shape) < 2) or any(
      jnp.shape(a) not in allowed for a in xs):
    form = "2-D [r, c]" if two_d else "[tokens, ..., k]"
    raise ValueError(f"{op}: `x` must be {form}; as a prologue's operands each of its "
                     f"shape, a vector of its last dim or a column ([..., 1]), got shapes "
                     f"{[jnp.shape(a) for a in xs]}")
  return xs


def flat_operands(op: str, x, prologue):
  """An op's input as 2-D operands (:func:`operands`, the leading dims folded
  into one), and its leading dims."""
  xs = operands(op, x, prologue)
  return (tuple(a if a.ndim == 1 else a.reshape(-1, a.shape[-1]) for a in xs),
          jnp.shape(xs[0])[:-1])
