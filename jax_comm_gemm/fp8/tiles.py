"""What one program of the FP8 cast kernels (:mod:`jax_comm_gemm.fp8.cast`,
:mod:`jax_comm_gemm.fp8.heads`) does: the blocks it reads and writes, its
tile loaded in float32 through a prologue, the tile cast, transposed, its
amax and column sums. A gated product's prologue reads both halves of one
operand and its gradient writes a pair (:mod:`jax_comm_gemm.fp8.prologue`):
a program reads each half's tile where it lies, and writes both of its
output tiles, so neither half is sliced out nor concatenated in memory."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_comm_gemm.fp8.prologue import applied
from jax_comm_gemm.fp8.quantize import F32


def operand_blocks(xs, rows: int, columns: int, halves: tuple = ()):
  """The kernel's operands and their blocks: a tile, a vector's slice of
  columns, or a column's slice of rows; an operand of two halves (positions
  `halves`, ``[r, 2c]``) as ``[r, 2, c]`` twice, its first half's tile then
  its second's (the same bytes, read where they lie)."""
  out = []
  for i, a in enumerate(xs):
    if i in halves:
      a = a.reshape(a.shape[0], 2, a.shape[1] // 2)  # no copy
      out += [(a, pl.BlockSpec((rows, pl.squeezed, columns), lambda i, j, h=h: (i, h, j)))
              for h in (0, 1)]
    elif a.ndim == 1:
      out.append((a, pl.BlockSpec((columns,), lambda i, j: (j,))))
    elif a.shape[1] == 1 < columns:
      out.append((a, pl.BlockSpec((rows, 1), lambda i, j: (i, 0))))
    else:
      out.append((a, pl.BlockSpec((rows, columns), lambda i, j: (i, j))))
  return [a for a, _ in out], [b for _, b in out]


def output_blocks(shape, tiling, pair: bool, rows: bool, columns: bool, with_amax: bool,
                  with_column_sums: bool):
  """(written?, shape, dtype or None (the FP8 type), block) of the cast's outputs
  for x of `shape` ``(r, c)`` in tiles ``(tr, tc)``: its rows ``[r, n, c]``,
  transposed columns ``[n, c, r]``, one amax per tile, and one row of column
  sums ``[n, c]`` per tile row (amaxes and sums reduced after the kernel);
  n = 2 halves for a `pair` (the ``[r, 2c]`` pair's own layout: reshapes, no
  copies), else x's own ``[r, c]``, ``[c, r]``, ``[c]``."""
  (r, c), (tr, tc) = shape, tiling
  amax = (with_amax, (r // tr, c // tc), F32, pl.BlockSpec((1, 1), lambda i, j: (i, j)))
  if not pair:
    return [(rows, (r, c), None, pl.BlockSpec((tr, tc), lambda i, j: (i, j))),
            (columns, (c, r), None, pl.BlockSpec((tc, tr), lambda i, j: (j, i))), amax,
            (with_column_sums, (r // tr, c), F32, pl.BlockSpec((1, tc), lambda i, j: (i, j)))]
  return [(rows, (r, 2, c), None, pl.BlockSpec((tr, 2, tc), lambda i, j: (i, 0, j))),
          (columns, (2, c, r), None, pl.BlockSpec((2, tc, tr), lambda i, j: (0, j, i))), amax,
          (with_column_sums, (r // tr, 2, c), F32,
           pl.BlockSpec((1, 2, tc), lambda i, j: (i, 0, j)))]


def load(x_refs, prologue):
  """The program's tile in float32, through `prologue` as
  :func:`.prologue.activated` computes it: a tuple of one tile, or of two
  where the prologue returns a pair."""
  tiles = tuple(r[...] for r in x_refs)
  if prologue is None:
    return (tiles[0].astype(F32),)
  return tuple(t.astype(F32) for t in applied(tiles, prologue, tiles[0].dtype))


def tile_amax(*tiles):
  """The float32 tiles' ``max(|x|)``, NaN if one holds one (Triton's float max
  drops NaN): an integer max of the magnitudes' bits, which order as the
  magnitudes do, every NaN's above inf's."""
  bits = [jnp.max(lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF) for x in tiles]
  return lax.bitcast_convert_type(functools.reduce(jnp.maximum, bits), F32)


def amax_tile(flag_ref, *refs, prologue):
  """:func:`jax_comm_gemm.fp8.cast.amax_if`'s program: its tile's amax where
  the flag says it is wanted, else 0 (the tile not read)."""
  *x_refs, out_ref = refs
  wanted = flag_ref[0] != 0

  @pl.when(wanted)
  def _():
    out_ref[...] = jnp.full((1, 1), tile_amax(*load(x_refs, prologue)), F32)

  @pl.when(jnp.logical_not(wanted))
  def _():
    out_ref[...] = jnp.zeros((1, 1), F32)


def cast_tile(load, scale_ref, *refs, operands, limit, dtype, rows, columns, with_amax,
              with_column_sums):
  """One program's tile: `load` reads it from the input refs in float32, one
  tile or a tuple of them (a pair's two halves: each output block then holds
  both, along its axis 1 (rows, sums) or 0 (columns), :func:`output_blocks`)."""
  x_refs, out_refs = refs[:operands], refs[operands:]
  xs = load(x_refs)
  xs = xs if isinstance(xs, tuple) else (xs,)
  pair = len(xs) == 2

  def store(ref, values, axis):
    for half, value in enumerate(values):
      if not pair:
        ref[...] = value
      elif axis == 0:
        ref[half] = value
      else:
        ref[:, half, :] = value

  qs = []
  for x in xs:
    y = x * scale_ref[0]
    # As quantize.saturating_cast: NaN stays NaN (Triton's min/max drop it).
    y = jnp.where(y != y, y, jnp.clip(y, -limit, limit))
    qs.append(y.astype(dtype))
  outs = iter(out_refs)
  if rows:
    store(next(outs), qs, 1)
  if columns:  # the FP8 tile transposed: a quarter of float32's bytes through shared memory
    store(next(outs), [q.T for q in qs], 0)
  if with_amax:
    next(outs)[...] = jnp.full((1, 1), tile_amax(*xs), F32)
  if with_column_sums:
    store(next(outs), [jnp.sum(x, axis=0, keepdims=True) for x in xs], 1)
