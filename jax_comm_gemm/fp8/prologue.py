"""The elementwise functions that an FP8 cast applies inside its own pass over
memory (:func:`jax_comm_gemm.fp8.cast.cast_transpose`'s `prologue`), so that
their output is never written in bf16: a LayerNorm's or an RMSNorm's
normalization from its row statistics, the MLP's activation, the activation after fc1's bias, and
the gradient through either (its backward).

A prologue takes one or more operands: tensors of x's shape ``[r, c]``,
vectors ``[c]`` broadcast over the rows (a bias), or columns ``[r, 1]``
broadcast over the columns (a row's statistic). A gated MLP's product adds
two forms (:func:`gated`): an operand of two of x's tensors side by side,
``[r, 2c]`` of columns ``({first, second}, c)`` (gate and up, one GEMM's
output), which the prologue receives as two arguments (:func:`halves`); and
a prologue that returns two tensors of x's shape, written side by side as
``[r, 2c]`` (their gradient, for their one weight-gradient GEMM;
:func:`pair_output`). The kernels read and write each half's tile where it
lies: neither half is sliced out or concatenated in memory. Each function
here is made once per activation (cached), so that a kernel compiles once
for it.

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
  parts = applied(split_halves(xs, prologue), prologue, xs[0].dtype)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def applied(args, prologue, dtype) -> tuple:
  """``prologue(*args)`` on its arguments (halves already split) in float32
  (float64 for float64 `dtype`), each output rounded to `dtype`: a tuple of
  one tensor, or of two where it returns a pair. The kernels call it on their
  tiles, :func:`activated` on whole operands: one definition of the
  arithmetic."""
  wide = jnp.promote_types(dtype, F32)
  out = prologue(*(jnp.asarray(a, wide) for a in args))
  return tuple(o.astype(dtype) for o in (out if isinstance(out, tuple) else (out,)))


def halves(prologue) -> tuple[int, ...]:
  """The positions of `prologue`'s operands that hold two tensors of x's
  shape side by side (``[r, 2c]``, columns ``({first, second}, c)``), each
  passed to it as two arguments, first then second; () for most."""
  return tuple(getattr(prologue, "halves", ()))


def pair_output(prologue) -> bool:
  """Whether `prologue` returns two tensors of x's shape (written side by
  side, ``[r, 2c]``)."""
  return bool(getattr(prologue, "pair_output", False))


def split_halves(xs: tuple, prologue) -> tuple:
  """The prologue's arguments: `xs` with each halves operand (:func:`halves`)
  split into its two column halves (XLA fuses the slices into their reader)."""
  pairs = halves(prologue)
  return tuple(p for i, a in enumerate(xs)
               for p in (jnp.split(a, 2, axis=-1) if i in pairs else (a,)))


def tile_shape(xs: tuple, prologue) -> tuple:
  """The shape of x, the tensor each operand's tile lines up with: the first
  operand's, its columns halved where it holds two halves."""
  shape = tuple(jnp.shape(xs[0]))
  return shape[:-1] + (shape[-1] // 2,) if 0 in halves(prologue) else shape


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
  pair = 0 in halves(activation)  # x is two arguments: its gradient is their two

  def gradient(dy, *xs):
    grads = jax.vjp(activation, *xs)[1](dy)
    return tuple(grads[:2]) if pair else grads[0]
  gradient.__name__ = "d" + getattr(activation, "__name__", "activation")
  gradient.halves = tuple(i + 1 for i in halves(activation))  # after dy
  gradient.pair_output = pair
  return gradient


@functools.cache
def gated(activation):
  """The gated product ``(g, u) -> activation(g) * u`` (SwiGLU for
  ``jax.nn.silu``, GeGLU for ``jax.nn.gelu``, named so: profiles and kernels
  name it) of one operand, the gate-and-up GEMM's output ``[r, 2c]``, gate
  columns then up columns (:func:`halves`). Inside down's FP8 cast it is made
  from the two halves' tiles where they lie; its gradient
  (:func:`activation_gradient`) is the pair ``[d gate, d up]``, written
  side by side for gate and up's weight-gradient GEMM.

  >>> f = gated(jax.nn.relu)
  >>> f.__name__, activated(jnp.array([[-1.0, 2.0, 3.0, 4.0]]), f).tolist()
  ('glu_relu', [[0.0, 8.0]])
  """
  def glu(g, u):
    return activation(g) * u
  names = {jax.nn.silu: "swiglu", jax.nn.swish: "swiglu", jax.nn.gelu: "geglu"}
  glu.__name__ = names.get(activation, "glu_" + getattr(activation, "__name__", "activation"))
  glu.halves = (0,)
  return glu


def check_not_gated(op: str, activation) -> None:
  """An op that applies `activation` to one tensor of its own refuses a gated
  product, which reads gate's and up's GEMM output (:func:`gated`; fp8_mlp
  makes both)."""
  if halves(activation):
    raise ValueError(f"{op}: a gated `activation` ({activation.__name__}) reads gate's "
                     f"and up's GEMM output, which this op does not make: use fp8_mlp")


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
  shape, pairs = tile_shape(xs, prologue), halves(prologue)
  allowed = (shape, shape[-1:], shape[:-1] + (1,))
  two = shape[:-1] + (2 * shape[-1],)  # a halves operand
  if (len(shape) != 2 if two_d else len(shape) < 2) or any(
      jnp.shape(a) != two if i in pairs else jnp.shape(a) not in allowed
      for i, a in enumerate(xs)):
    form = "2-D [r, c]" if two_d else "[tokens, ..., k]"
    also = f"; operands {list(pairs)} its two halves side by side [..., 2c]" if pairs else ""
    raise ValueError(f"{op}: `x` must be {form}; as a prologue's operands each of its "
                     f"shape, a vector of its last dim or a column ([..., 1]){also}, got "
                     f"shapes {[jnp.shape(a) for a in xs]}")
  return xs


def flat_operands(op: str, x, prologue):
  """An op's input as 2-D operands (:func:`operands`, the leading dims folded
  into one), and its leading dims."""
  xs = operands(op, x, prologue)
  return (tuple(a if a.ndim == 1 else a.reshape(-1, a.shape[-1]) for a in xs),
          jnp.shape(xs[0])[:-1])
