"""One pass over a tensor for its FP8 copies: ``cast_transpose`` reads a 2-D
bf16 / f16 / f32 `x` once and writes ``sat(x * scale)`` in FP8 row-major, its
transpose (the TN operand of a GEMM over x's rows), and, where asked, x's
amax (delayed scaling knows its scale before the cast, so the amax it records
for the next steps comes from the same pass). Where x is the input of an
elementwise `prologue` (an activation, or the gradient through one), the
pass applies it first: its output is never written in x's dtype; and where
a bias's gradient needs the column sums of that output, the pass writes
them too.

XLA makes each of those a pass of its own. On a GPU a Pallas (Triton) kernel
does them in one: each program loads one tile, writes it and its transpose,
and reduces the tile's amax. Elsewhere, or where the tiles do not divide x,
the same arithmetic runs in plain jax. Both round the same way (to nearest
even, after clipping to the FP8 range), so the two agree bit for bit.
Measurements: docs/fp8.md ("Fused casts").

>>> import jax.numpy as jnp
>>> q, qT, a = cast_transpose(jnp.array([[1.0, -2.0], [0.5, 1000.0]]), 1.0,
...                           jnp.float8_e4m3fn, with_amax=True)
>>> q.astype(jnp.float32).tolist(), qT.astype(jnp.float32).tolist(), float(a)
([[1.0, -2.0], [0.5, 448.0]], [[1.0, 0.5], [-2.0, 448.0]], 1000.0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jax_comm_gemm import vma
import jax_comm_gemm.fp8.tiles as tiles
from jax_comm_gemm.fp8.prologue import activated, halves, operands, pair_output, tile_shape
from jax_comm_gemm.fp8.quantize import F32, fp8_max, saturating_cast

IMPLEMENTATIONS = ("auto", "pallas", "xla")
# Each program's tile (rows, columns) and Triton warps, for the cast, the cast
# with a prologue (it reads more per tile), and the FP8 transpose: measured
# on an H200, the prologue's on an H100 (docs/fp8.md, "Fused casts").
CAST_TILING = (64, 64, 8)
PROLOGUE_TILING = (64, 64, 4)
MOVE_TILING = (128, 128, 4)
TILE = 128  # both tilings' sides divide it: the kernels take x whose dims it divides


def cast_transpose(x, scale, dtype, *, rows: bool = True, columns: bool = True,
                   with_amax: bool = False, implementation: str = "auto", prologue=None,
                   with_column_sums: bool = False):
  """``(q, qT, amax)`` of a 2-D `x` ``[r, c]``: ``q = sat(x * scale)`` ``[r, c]``
  and its transpose ``qT`` ``[c, r]`` in FP8 `dtype` (each None unless asked
  for by `rows` / `columns`), and ``max(|x|)`` in float32 (None unless
  `with_amax`; NaN if x holds one). `scale` is a float32 scalar.
  `implementation`: ``"pallas"`` (the one-pass GPU kernel), ``"xla"`` (plain
  jax), or ``"auto"`` (the kernel on a GPU where the tiles divide x, for a
  transposed copy, an amax or sums: XLA fuses a row-major cast alone into
  x's producer). `prologue`: an elementwise function (:mod:`.prologue`) that
  the pass applies first: all outputs are of ``prologue(x)``, x then maybe a
  tuple of its operands. `with_column_sums`: also return the float32 column
  sums ``[c]`` of what is cast (a bias's gradient). A gated product's
  prologue (:func:`.prologue.gated`) reads an operand of two halves
  ``[r, 2c]`` and its gradient writes two: each program reads (and writes)
  both halves' tiles where they lie, and the outputs are of the ``[r, 2c]``
  the pair makes.

  >>> q, _, a = cast_transpose(jnp.array([[-1.0, 2.0]]), 1.0, jnp.float8_e4m3fn,
  ...                          columns=False, with_amax=True, prologue=jax.nn.relu)
  >>> q.astype(jnp.float32).tolist(), float(a)
  ([[0.0, 2.0]], 2.0)
  """
  check_implementation("cast_transpose", implementation)
  xs = operands("cast_transpose", x, prologue, two_d=True)
  if not (rows or columns or with_amax or with_column_sums):
    return None, None, None
  if implementation == "auto":  # a row-major cast alone XLA fuses into its producer
    implementation = ("pallas" if (columns or with_amax or with_column_sums)
                      and _kernel_runs(_tiled(xs, prologue)) else "xla")
  if implementation == "xla":
    a = activated(x, prologue)
    out = _xla(a, scale, dtype, rows, columns, with_amax)
    return out + (jnp.sum(a.astype(F32), axis=0),) if with_column_sums else out
  # The kernel's operands must vary alike (inside shard_map): the agreed scale as x.
  *xs, scale = vma.match(*xs, jnp.reshape(jnp.asarray(scale, F32), (1,)))
  out = _pallas(tuple(xs), scale, jnp.dtype(dtype), rows, columns, with_amax,
                with_column_sums, PROLOGUE_TILING if prologue else CAST_TILING, prologue,
                interpret=jax.default_backend() != "gpu")
  return out if with_column_sums else out[:3]


def _tiled(xs, prologue):
  """x's shape, which the tiles cut (:func:`.prologue.tile_shape`), as an array
  shape for :func:`_kernel_runs`."""
  return jax.ShapeDtypeStruct(tile_shape(xs, prologue), xs[0].dtype)


def check_implementation(op: str, implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")


def _kernel_runs(x) -> bool:
  """Whether the kernel takes x here: a GPU backend, tiles that divide x."""
  return jax.default_backend() == "gpu" and all(d % TILE == 0 for d in x.shape)


def _xla(x, scale, dtype, rows, columns, with_amax):
  return (saturating_cast(x, scale, dtype) if rows else None,
          saturating_cast(x.T, scale, dtype) if columns else None,
          xla_amax(x) if with_amax else None)


def xla_amax(x):
  """``max(|x|)`` in float32, NaN wherever x holds one (XLA's max may return a
  larger inf)."""
  return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), jnp.max(jnp.abs(x.astype(F32))))


def transpose(q, *, batch: int = 1, implementation: str = "auto"):
  """``q.T`` of a 2-D FP8 `q`, materialized: the TN operand that a GEMM over
  q's rows reads (a gathered FP8 operand, whose bytes and scale it keeps).
  XLA's transpose of one-byte elements runs far below the memory's speed; the
  kernel moves tiles (`implementation` as in :func:`cast_transpose`).

  `batch` > 1 (it divides q's rows): the rows are tokens ``(position,
  batch)``, qT's columns ``(batch, position)``, as :func:`.heads.cast_heads`
  writes the other operand of their weight gradient.

  >>> q = jnp.arange(8.0).reshape(4, 2).astype(jnp.float8_e4m3fn)  # 2 positions x 2 batch
  >>> transpose(q, batch=2).astype(jnp.float32).tolist()
  [[0.0, 4.0, 2.0, 6.0], [1.0, 5.0, 3.0, 7.0]]
  """
  check_implementation("transpose", implementation)
  (r, c), tiles = q.shape, MOVE_TILING[0] * batch
  if implementation == "auto":
    implementation = "pallas" if _kernel_runs(q) and r % tiles == 0 else "xla"
  if implementation == "xla":
    return q.reshape(r // batch, batch, c).transpose(2, 1, 0).reshape(c, r)
  # As bytes: the kernel only moves them.
  bT = _move(lax.bitcast_convert_type(q, jnp.uint8), batch,
             interpret=jax.default_backend() != "gpu")
  return lax.bitcast_convert_type(bT, q.dtype)


@functools.partial(jax.jit, static_argnums=(1, 2), static_argnames=("interpret",))
def _move(b, batch, tiling=MOVE_TILING, *, interpret=False):
  """:func:`transpose`'s kernel: each program moves one batch element's tile
  (its rows read with a stride where `batch` > 1), transposed."""
  r, c = b.shape
  s = r // batch
  tr, tc, warps = tiling
  sq = pl.squeezed
  out = pl.pallas_call(
      _move_tile, vma.shaped_like(b, (c, batch, s), b.dtype), grid=(s // tr, batch, c // tc),
      in_specs=[pl.BlockSpec((tr, sq, tc), lambda i, k, j: (i, k, j))],
      out_specs=pl.BlockSpec((tc, sq, tr), lambda i, k, j: (j, k, i)), interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=warps),
      name="fp8_transpose")(b.reshape(s, batch, c))
  return out.reshape(c, r)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8),
                   static_argnames=("interpret",))
def _pallas(xs, scale, dtype, rows, columns, with_amax, with_column_sums, tiling, prologue, *,
            interpret=False):
  """The one-pass kernel over the tuple `xs` (one array, or a prologue's
  operands), `tiling` = (tile rows, tile columns, warps). Where the prologue
  returns a pair, each output holds both halves (``[r, 2, c]``, ``[2, c,
  r]``, ``[2, c]`` sums: the ``[r, 2c]`` pair's rows, columns and sums
  without a copy) and each program writes its tile of each."""
  x = xs[0]
  r, c = tile_shape(xs, prologue)
  tr, tc, warps = tiling
  grid = (r // tr, c // tc)
  outputs = tiles.output_blocks((r, c), (tr, tc), pair_output(prologue), rows, columns,
                                with_amax, with_column_sums)
  out_shape = [vma.shaped_like(x, shape, dt or dtype) for on, shape, dt, _ in outputs if on]
  out_specs = [block for on, _, _, block in outputs if on]
  arrays, blocks = tiles.operand_blocks(xs, tr, tc, halves(prologue))
  kernel = functools.partial(tiles.cast_tile, functools.partial(tiles.load, prologue=prologue),
                             operands=len(arrays), limit=fp8_max(dtype), dtype=dtype,
                             rows=rows, columns=columns, with_amax=with_amax,
                             with_column_sums=with_column_sums)
  in_specs = [pl.BlockSpec((1,), lambda i, j: (0,))] + blocks
  outs = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, interpret=interpret,
                        compiler_params=plt.CompilerParams(num_warps=warps),
                        name=_kernel_name(rows, columns, with_amax, with_column_sums,
                                          prologue))(scale, *arrays)
  width = 2 * c if pair_output(prologue) else c
  outs = iter(outs)
  q = next(outs).reshape(r, width) if rows else None
  qT = next(outs).reshape(width, r) if columns else None
  a = max_of_tiles(next(outs)) if with_amax else None
  sums = jnp.sum(next(outs), axis=0).reshape(width) if with_column_sums else None
  return q, qT, a, sums


def _kernel_name(rows, columns, with_amax, with_column_sums, prologue) -> str:
  """What a kernel writes, in its name, so that a profile tells the casts
  apart: e.g. "fp8_cast_rows_columns_amax_gelu", "fp8_transpose"."""
  parts = [p for p, on in (("rows", rows), ("columns", columns), ("amax", with_amax),
                           ("sums", with_column_sums)) if on]
  activation = [] if prologue is None else [getattr(prologue, "__name__", "prologue")]
  return "_".join(["fp8_cast", *parts, *activation])


def max_of_tiles(partial):
  """The largest of the kernel's per-tile amaxes, reduced in a fusion of its
  own: XLA otherwise fuses the reduction into its scalar consumer (a history's
  concatenate, a scale) and reduces serially in one thread (milliseconds a
  step at the GPU preset, docs/fp8.md)."""
  return lax.optimization_barrier(jnp.max(partial))


def amax_if(x, wanted, *, implementation: str = "auto", prologue=None):
  """``max(|x|)`` in float32 where the scalar bool `wanted` (a traced value) is
  true, else 0, reading x only where wanted (delayed scaling's first step). On
  a GPU a kernel whose programs return at once unless wanted (a ``lax.cond``
  waits on the host for its predicate); elsewhere, or where the tiles do not
  divide x, plain jax. NaN if x holds one (`implementation` and
  `prologue` as in :func:`cast_transpose`).

  >>> import jax.numpy as jnp
  >>> float(amax_if(jnp.array([[1.0, -3.0]]), True)), float(amax_if(jnp.array([[1.0]]), False))
  (3.0, 0.0)
  """
  check_implementation("amax_if", implementation)
  xs = operands("amax_if", x, prologue, two_d=True)
  if implementation == "auto":
    implementation = "pallas" if _kernel_runs(_tiled(xs, prologue)) else "xla"
  if implementation == "xla":
    return jnp.where(wanted, xla_amax(activated(x, prologue)), jnp.float32(0))
  *xs, flag = vma.match(*xs, jnp.reshape(jnp.asarray(wanted, jnp.int32), (1,)))
  return _amax_if(tuple(xs), flag, prologue, interpret=jax.default_backend() != "gpu")


@functools.partial(jax.jit, static_argnums=(2,), static_argnames=("interpret",))
def _amax_if(xs, flag, prologue, *, interpret=False):
  r, c = tile_shape(xs, prologue)
  grid = (r // TILE, c // TILE)
  arrays, blocks = tiles.operand_blocks(xs, TILE, TILE, halves(prologue))
  partial = pl.pallas_call(
      functools.partial(tiles.amax_tile, prologue=prologue),
      out_shape=vma.shaped_like(xs[0], grid, F32), grid=grid,
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,))] + blocks,
      out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)), interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4), name="fp8_amax_if")(flag, *arrays)
  return max_of_tiles(partial)


def _move_tile(x_ref, xT_ref):
  xT_ref[...] = x_ref[...].T
