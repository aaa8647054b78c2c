"""Current-scaling FP8 quantization: amax, scale, saturating cast.

Conventions: ``scale`` multiplies a value into the FP8 range
(``q = sat(x * scale)``); ``scale_inv = 1 / scale`` multiplies it back
(``x ~ q * scale_inv``). The helpers return ``scale_inv``, the factor the GEMM
applies to its output. Everything is traceable (jit, shard_map, vmap).

>>> import jax.numpy as jnp
>>> q, inv = quantize_tensor(jnp.array([[1.0, -2.0], [0.5, 4.0]]), jnp.float8_e4m3fn)
>>> round(float(inv) * 448.0, 5)
4.0
>>> q.astype(jnp.float32).tolist()
[[112.0, -224.0], [56.0, 448.0]]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
_F32_MAX = float(np.finfo(np.float32).max)


def fp8_max(dtype) -> float:
  """The largest finite value of an FP8 `dtype` (448 for E4M3, 57344 for E5M2).

  >>> fp8_max(jnp.float8_e4m3fn), fp8_max(jnp.float8_e5m2)
  (448.0, 57344.0)
  """
  return float(jnp.finfo(dtype).max)


def amax(x, axis=None, keepdims: bool = False, axis_name: str | None = None):
  """``max(|x|)`` in float32, over `axis` (all by default), then (``axis_name``)
  over the mesh axis with ``lax.pmax``. NaN propagates; inf gives inf.

  >>> amax(jnp.array([[1.0, -3.0], [2.0, 0.5]]), axis=1).tolist()
  [3.0, 2.0]
  """
  a = jnp.max(jnp.abs(x.astype(F32)), axis=axis, keepdims=keepdims)
  return agree(a, axis_name)


def agree(amaxes, axis_name: str | None):
  """`amaxes` (an array or a tuple of them) maxed over `axis_name` in ONE
  ``lax.pmax`` (one all-reduce); unchanged for None or a group of one. NaN is
  mapped to inf first, so that the agreed amax is non-finite wherever a rank's
  is, whatever the all-reduce does with NaN.

  >>> float(agree(jnp.float32(2.0), None))  # no axis: unchanged
  2.0
  """
  if axis_name is None or lax.axis_size(axis_name) == 1:
    return amaxes
  nan_to_inf = lambda a: jnp.where(jnp.isnan(a), jnp.inf, a)
  if isinstance(amaxes, tuple):
    return lax.pmax(tuple(nan_to_inf(a) for a in amaxes), axis_name)
  return lax.pmax(nan_to_inf(amaxes), axis_name)


def scale_from_amax(a, dtype, margin: int = 0):
  """``fp8_max / amax / 2**margin`` (float32); 1 where ``amax == 0``; at most
  float32's max. A NaN amax gives NaN, an inf amax 0.

  >>> scale_from_amax(jnp.array([4.0, 0.0]), jnp.float8_e4m3fn).tolist()
  [112.0, 1.0]
  """
  a = jnp.asarray(a, F32)
  scale = jnp.float32(fp8_max(dtype) / 2.0 ** margin) / jnp.where(a == 0, 1.0, a)
  scale = jnp.where(a == 0, jnp.float32(1.0), scale)
  return jnp.where(jnp.isnan(scale), scale, jnp.minimum(scale, _F32_MAX))


def saturating_cast(x, scale, dtype):
  """``x * scale`` clipped to ``+-fp8_max(dtype)`` and rounded (to nearest
  even) to `dtype`. NaN stays NaN; +-inf becomes +-max (only reachable with a
  finite scale that was not computed from this x).

  >>> saturating_cast(jnp.array([1000.0, -2.0]), 1.0, jnp.float8_e4m3fn).tolist()
  [448.0, -2.0]
  """
  limit = fp8_max(dtype)
  y = x.astype(F32) * scale
  # Said, not left to clip: XLA's clamp lets NaN through on some backends and
  # versions, not on others (jax 0.12's CPU clamps it to max).
  return jnp.where(jnp.isnan(y), y, jnp.clip(y, -limit, limit)).astype(dtype)


def inverse(scale):
  """``1 / scale`` (float32): the dequantization factor.

  >>> float(inverse(jnp.float32(4.0)))
  0.25
  """
  return jnp.float32(1.0) / scale


def quantize_tensor(x, dtype, *, margin: int = 0, axis_name: str | None = None):
  """One scale for all of `x` (agreed over `axis_name` if given):
  ``(q, scale_inv)`` with a scalar ``scale_inv``.

  >>> q, inv = quantize_tensor(jnp.array([2.0, -1.0]), jnp.float8_e4m3fn)
  >>> (q.astype(jnp.float32) * inv).round(5).tolist()
  [2.0, -1.0]
  """
  scale = scale_from_amax(amax(x, axis_name=axis_name), dtype, margin)
  return saturating_cast(x, scale, dtype), inverse(scale)


def quantize_rows(x, dtype, *, margin: int = 0):
  """One scale per row of a 2-D `x`: ``(q [r, c], scale_inv [r])``.

  >>> q, inv = quantize_rows(jnp.array([[1.0, 2.0], [0.0, 0.0]]), jnp.float8_e4m3fn)
  >>> q.astype(jnp.float32).tolist(), (inv * 448).round(5).tolist()
  ([[224.0, 448.0], [0.0, 0.0]], [2.0, 448.0])
  """
  scale = scale_from_amax(amax(x, axis=1, keepdims=True), dtype, margin)
  return saturating_cast(x, scale, dtype), inverse(scale)[:, 0]


def quantize_columns_transposed(x, dtype, *, margin: int = 0):
  """One scale per column of a 2-D `x`, written transposed (the TN operand of
  a GEMM that contracts over x's rows): ``(q [c, r], scale_inv [c])``.

  >>> q, inv = quantize_columns_transposed(jnp.array([[1.0, 4.0], [2.0, 8.0]]),
  ...                                      jnp.float8_e4m3fn)
  >>> q.shape, (inv * 448).round(5).tolist()
  ((2, 2), [2.0, 8.0])
  """
  return quantize_rows(x.T, dtype, margin=margin)


# The side of a scaling block ("block" scaling: 1 x BLOCK and BLOCK x BLOCK).
BLOCK = 128


def quantize_blocks(x, dtype, block_rows: int, *, margin: int = 0):
  """One scale per block of `block_rows` rows by :data:`BLOCK` columns of a
  2-D `x` whose dims they divide: ``(q [r, c], scale_inv [r / block_rows,
  c / BLOCK])``. ``block_rows=1``: 1 x 128 (activations, gradients);
  ``block_rows=BLOCK``: 128 x 128 (weights).

  >>> x = jnp.concatenate([jnp.ones((2, 128)), 4 * jnp.ones((2, 128))], axis=1)
  >>> q, inv = quantize_blocks(x, jnp.float8_e4m3fn, 1)
  >>> q.shape, (inv * 448).tolist()
  ((2, 256), [[1.0, 4.0], [1.0, 4.0]])
  """
  r, c = x.shape
  blocks = x.astype(F32).reshape(r // block_rows, block_rows, c // BLOCK, BLOCK)
  scale = scale_from_amax(jnp.max(jnp.abs(blocks), axis=(1, 3)), dtype, margin)
  q = saturating_cast(blocks, scale[:, None, :, None], dtype)
  return q.reshape(r, c), inverse(scale)


def dequantize(q, scale_inv, dtype=F32):
  """``q * scale_inv`` in `dtype`: a scalar `scale_inv` scales all of q, a
  vector q's rows, a matrix q's blocks (:func:`quantize_blocks`).

  >>> dequantize(jnp.array([[2.0], [2.0]]).astype(jnp.float8_e4m3fn), jnp.array([0.5, 2.0])).tolist()
  [[1.0], [4.0]]
  """
  inv = jnp.asarray(scale_inv, F32)
  if inv.ndim == 2:  # blocks
    (r, c), (rb, cb) = q.shape, inv.shape
    blocks = q.astype(F32).reshape(rb, r // rb, cb, c // cb) * inv[:, None, :, None]
    return blocks.reshape(r, c).astype(dtype)
  if inv.ndim == 1:
    inv = inv[:, None]
  return (q.astype(F32) * inv).astype(dtype)
