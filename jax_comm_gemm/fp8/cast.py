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
from jax_comm_gemm.fp8.prologue import activated, operands
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
  sums ``[c]`` of what is cast (a bias's gradient).

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
                      and _kernel_runs(xs[0]) else "xla")
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


def _blocks(xs, rows, columns):
  """Each operand's block: a tile, a vector's slice of columns, or a column's
  slice of rows."""
  return [pl.BlockSpec((columns,), lambda i, j: (j,)) if a.ndim == 1
          else pl.BlockSpec((rows, 1), lambda i, j: (i, 0)) if a.shape[1] == 1 < columns
          else pl.BlockSpec((rows, columns), lambda i, j: (i, j)) for a in xs]


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
  operands), `tiling` = (tile rows, tile columns, warps)."""
  x = xs[0]
  r, c = x.shape
  tr, tc, warps = tiling
  grid = (r // tr, c // tc)
  spec = pl.BlockSpec((tr, tc), lambda i, j: (i, j))
  # (written?, shape, dtype, block): the amaxes one per tile and the sums one
  # row per tile row, reduced below (tiny reductions).
  outputs = [(rows, (r, c), dtype, spec),
             (columns, (c, r), dtype, pl.BlockSpec((tc, tr), lambda i, j: (j, i))),
             (with_amax, grid, F32, pl.BlockSpec((1, 1), lambda i, j: (i, j))),
             (with_column_sums, (grid[0], c), F32, pl.BlockSpec((1, tc), lambda i, j: (i, j)))]
  out_shape = [vma.shaped_like(x, shape, dt) for on, shape, dt, _ in outputs if on]
  out_specs = [block for on, _, _, block in outputs if on]
  kernel = functools.partial(cast_tile, functools.partial(_tile, prologue=prologue),
                             operands=len(xs), limit=fp8_max(dtype), dtype=dtype, rows=rows,
                             columns=columns, with_amax=with_amax,
                             with_column_sums=with_column_sums)
  in_specs = [pl.BlockSpec((1,), lambda i, j: (0,))] + _blocks(xs, tr, tc)
  outs = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, interpret=interpret,
                        compiler_params=plt.CompilerParams(num_warps=warps),
                        name=_kernel_name(rows, columns, with_amax, with_column_sums,
                                          prologue))(scale, *xs)
  outs = iter(outs)
  q = next(outs) if rows else None
  qT = next(outs) if columns else None
  a = max_of_tiles(next(outs)) if with_amax else None
  sums = jnp.sum(next(outs), axis=0) if with_column_sums else None
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
    implementation = "pallas" if _kernel_runs(xs[0]) else "xla"
  if implementation == "xla":
    return jnp.where(wanted, xla_amax(activated(x, prologue)), jnp.float32(0))
  *xs, flag = vma.match(*xs, jnp.reshape(jnp.asarray(wanted, jnp.int32), (1,)))
  return _amax_if(tuple(xs), flag, prologue, interpret=jax.default_backend() != "gpu")


@functools.partial(jax.jit, static_argnums=(2,), static_argnames=("interpret",))
def _amax_if(xs, flag, prologue, *, interpret=False):
  r, c = xs[0].shape
  grid = (r // TILE, c // TILE)
  partial = pl.pallas_call(
      functools.partial(_amax_kernel, prologue=prologue),
      out_shape=vma.shaped_like(xs[0], grid, F32), grid=grid,
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,))]
      + _blocks(xs, TILE, TILE),
      out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)), interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4), name="fp8_amax_if")(flag, *xs)
  return max_of_tiles(partial)


def _amax_kernel(flag_ref, *refs, prologue):
  *x_refs, out_ref = refs
  wanted = flag_ref[0] != 0

  @pl.when(wanted)
  def _():
    out_ref[...] = jnp.full((1, 1), _tile_amax(_tile(x_refs, prologue)), F32)

  @pl.when(jnp.logical_not(wanted))
  def _():
    out_ref[...] = jnp.zeros((1, 1), F32)


def _tile_amax(x):
  """A float32 tile's ``max(|x|)``, NaN if it holds one (Triton's float max drops
  NaN): one integer max of the magnitudes' bits, which order as the magnitudes
  do, every NaN's above inf's."""
  bits = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
  return lax.bitcast_convert_type(jnp.max(bits), F32)


def _move_tile(x_ref, xT_ref):
  xT_ref[...] = x_ref[...].T


def _tile(x_refs, prologue):
  """The tile in float32, through `prologue` as :func:`activated` computes it."""
  tiles = tuple(r[...] for r in x_refs)
  return activated(tiles if prologue is not None else tiles[0], prologue).astype(F32)


def cast_tile(load, scale_ref, *refs, operands, limit, dtype, rows, columns, with_amax,
          with_column_sums):
  """One program's tile: `load` reads it from the input refs in float32."""
  x_refs, out_refs = refs[:operands], refs[operands:]
  x = load(x_refs)
  y = x * scale_ref[0]
  # As quantize.saturating_cast: NaN stays NaN (Triton's min/max drop it).
  y = jnp.where(y != y, y, jnp.clip(y, -limit, limit))
  q = y.astype(dtype)
  outs = iter(out_refs)
  if rows:
    next(outs)[...] = q
  if columns:  # the FP8 tile transposed: a quarter of float32's bytes through shared memory
    next(outs)[...] = q.T
  if with_amax:
    next(outs)[...] = jnp.full((1, 1), _tile_amax(x), F32)
  if with_column_sums:
    next(outs)[...] = jnp.sum(x, axis=0, keepdims=True)
