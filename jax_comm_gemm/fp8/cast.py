"""One pass over a tensor for its FP8 copies: ``cast_transpose`` reads a 2-D
bf16 / f16 / f32 `x` once and writes ``sat(x * scale)`` in FP8 row-major, its
transpose (the TN operand of a GEMM over x's rows), and, where asked, x's
amax (delayed scaling knows its scale before the cast, so the amax it records
for the next steps comes from the same pass). Where x is the input of an
elementwise `prologue` (an activation), the pass applies it first: the
activation's output is never written in x's dtype.

XLA makes each of those a pass of its own (a cast, a transposing cast, a
reduction). On a GPU a Pallas (Triton) kernel does them in one: each program
loads one tile, writes it and its transpose, and reduces the tile's amax.
Elsewhere, or where the tiles do not divide x, the same arithmetic runs in
plain jax. Both round the same way (to nearest even, after clipping to the
FP8 range), so the two agree bit for bit. Measurements: docs/fp8.md ("Fused casts").

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
from jax_comm_gemm.fp8.quantize import F32, fp8_max, saturating_cast

IMPLEMENTATIONS = ("auto", "pallas", "xla")
# Each program's tile (rows, columns) and Triton warps, for the cast and for
# the FP8 transpose: measured on an H200 (docs/fp8.md, "Fused casts").
CAST_TILING = (64, 64, 8)
MOVE_TILING = (128, 128, 4)
TILE = 128  # both tilings' sides divide it: the kernels take x whose dims it divides


def cast_transpose(x, scale, dtype, *, rows: bool = True, columns: bool = True,
                   with_amax: bool = False, implementation: str = "auto", prologue=None):
  """``(q, qT, amax)`` of a 2-D `x` ``[r, c]``: ``q = sat(x * scale)`` ``[r, c]``
  and its transpose ``qT`` ``[c, r]`` in FP8 `dtype` (each None unless asked
  for by `rows` / `columns`), and ``max(|x|)`` in float32 (None unless
  `with_amax`; NaN if x holds one). `scale` is a float32 scalar.
  `implementation`: ``"pallas"`` (the one-pass GPU kernel), ``"xla"`` (plain
  jax), or ``"auto"`` (the kernel on a GPU where the tiles divide x, for a
  transposed copy or an amax: XLA fuses a row-major cast alone into the op
  that produces x). `prologue`: an elementwise function (an activation) that
  the pass applies to x first, as :func:`activated` says; the copies and the
  amax are then of ``prologue(x)``.

  >>> q, _, a = cast_transpose(jnp.array([[-1.0, 2.0]]), 1.0, jnp.float8_e4m3fn,
  ...                          columns=False, with_amax=True, prologue=jax.nn.relu)
  >>> q.astype(jnp.float32).tolist(), float(a)
  ([[0.0, 2.0]], 2.0)
  """
  _check_implementation("cast_transpose", implementation)
  if jnp.ndim(x) != 2:
    raise ValueError(f"cast_transpose: x must be 2-D, got shape {jnp.shape(x)}")
  if not (rows or columns or with_amax):
    return None, None, None
  if implementation == "auto":  # a row-major cast alone XLA fuses into its producer
    implementation = "pallas" if (columns or with_amax) and _kernel_runs(x) else "xla"
  if implementation == "xla":
    return _xla(activated(x, prologue), scale, dtype, rows, columns, with_amax)
  # The kernel's operands must vary alike (inside shard_map): the agreed scale as x.
  x, scale = vma.match(x, jnp.reshape(jnp.asarray(scale, F32), (1,)))
  return _pallas(x, scale, jnp.dtype(dtype), rows, columns, with_amax, CAST_TILING,
                 prologue, interpret=jax.default_backend() != "gpu")


def activated(x, prologue):
  """``prologue(x)`` computed in float32 and rounded to x's dtype, as the op
  that writes an activation's output would round it; x itself without one.
  The kernels compute it so too, tile by tile."""
  if prologue is None:
    return x
  return prologue(x.astype(F32)).astype(x.dtype)


def _check_implementation(op: str, implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{op}: implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")


def _kernel_runs(x) -> bool:
  """Whether the kernel takes x here: a GPU backend, tiles that divide x."""
  return jax.default_backend() == "gpu" and all(d % TILE == 0 for d in x.shape)


def _xla(x, scale, dtype, rows, columns, with_amax):
  q = saturating_cast(x, scale, dtype) if rows else None
  qT = saturating_cast(x.T, scale, dtype) if columns else None
  return q, qT, (_xla_amax(x) if with_amax else None)


def _xla_amax(x):
  """``max(|x|)`` in float32, NaN wherever x holds one (XLA's max may return a
  larger inf)."""
  return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), jnp.max(jnp.abs(x.astype(F32))))


def transpose(q, *, implementation: str = "auto"):
  """``q.T`` of a 2-D FP8 `q`, materialized: the TN operand that a GEMM over
  q's rows reads (a gathered FP8 operand, whose bytes and scale it keeps).
  XLA's transpose of one-byte elements runs far below the memory's speed; the
  kernel moves tiles (`implementation` as in :func:`cast_transpose`)."""
  _check_implementation("transpose", implementation)
  if implementation == "auto":
    implementation = "pallas" if _kernel_runs(q) else "xla"
  if implementation == "xla":
    return q.T
  # As bytes: the kernel only moves them.
  b = lax.bitcast_convert_type(q, jnp.uint8)
  _, bT, _ = _pallas(b, None, jnp.dtype(jnp.uint8), False, True, False, MOVE_TILING, None,
                     interpret=jax.default_backend() != "gpu")
  return lax.bitcast_convert_type(bT, q.dtype)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7), static_argnames=("interpret",))
def _pallas(x, scale, dtype, rows, columns, with_amax, tiling, prologue, *, interpret=False):
  """The one-pass kernel, `tiling` = (tile rows, tile columns, warps); `scale`
  None: no cast (x's bytes, transposed)."""
  r, c = x.shape
  tr, tc, warps = tiling
  grid = (r // tr, c // tc)
  spec = pl.BlockSpec((tr, tc), lambda i, j: (i, j))
  out_shape, out_specs = [], []
  if rows:
    out_shape.append(vma.shaped_like(x, (r, c), dtype))
    out_specs.append(spec)
  if columns:
    out_shape.append(vma.shaped_like(x, (c, r), dtype))
    out_specs.append(pl.BlockSpec((tc, tr), lambda i, j: (j, i)))
  if with_amax:  # one partial amax per tile, maxed below (a tiny reduction)
    out_shape.append(vma.shaped_like(x, grid, F32))
    out_specs.append(pl.BlockSpec((1, 1), lambda i, j: (i, j)))
  if scale is None:
    kernel, args, in_specs = _move, (x,), [spec]
  else:
    kernel = functools.partial(_cast, limit=fp8_max(dtype), dtype=dtype, rows=rows,
                               columns=columns, with_amax=with_amax, prologue=prologue)
    args, in_specs = (scale, x), [pl.BlockSpec((1,), lambda i, j: (0,)), spec]
  outs = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, interpret=interpret,
                        compiler_params=plt.CompilerParams(num_warps=warps),
                        name=_kernel_name(scale is None, rows, columns, with_amax,
                                          prologue))(*args)
  outs = iter(outs)
  q = next(outs) if rows else None
  qT = next(outs) if columns else None
  a = _max_of_tiles(next(outs)) if with_amax else None
  return q, qT, a


def _kernel_name(move, rows, columns, with_amax, prologue) -> str:
  """What a kernel writes, in its name, so that a profile tells the casts
  apart: e.g. "fp8_cast_rows_columns_amax_gelu", "fp8_transpose"."""
  if move:
    return "fp8_transpose"
  parts = [p for p, on in (("rows", rows), ("columns", columns), ("amax", with_amax)) if on]
  if prologue is not None:
    parts.append(getattr(prologue, "__name__", "prologue"))
  return "_".join(["fp8_cast", *parts])


def _max_of_tiles(partial):
  """The largest of the kernel's per-tile amaxes, reduced in a fusion of its
  own: XLA otherwise fuses the reduction into its scalar consumer (a history's
  concatenate, a scale) and reduces serially in one thread (milliseconds a
  step at the GPU preset, docs/fp8.md)."""
  return lax.optimization_barrier(jnp.max(partial))


def amax_if(x, wanted, *, implementation: str = "auto", prologue=None):
  """``max(|x|)`` in float32 where the scalar bool `wanted` (a traced value) is
  true, else 0, reading x only where wanted: delayed scaling's first step needs
  this step's amax before its cast, the later steps only the history's. On a
  GPU a kernel whose programs return at once unless wanted (a ``lax.cond``
  would wait on the host for its predicate); elsewhere, or where the tiles do
  not divide x, plain jax. NaN if x holds one (`implementation` and
  `prologue` as in :func:`cast_transpose`).

  >>> import jax.numpy as jnp
  >>> float(amax_if(jnp.array([[1.0, -3.0]]), True)), float(amax_if(jnp.array([[1.0]]), False))
  (3.0, 0.0)
  """
  _check_implementation("amax_if", implementation)
  if jnp.ndim(x) != 2:
    raise ValueError(f"amax_if: x must be 2-D, got shape {jnp.shape(x)}")
  if implementation == "auto":
    implementation = "pallas" if _kernel_runs(x) else "xla"
  if implementation == "xla":
    return jnp.where(wanted, _xla_amax(activated(x, prologue)), jnp.float32(0))
  x, flag = vma.match(x, jnp.reshape(jnp.asarray(wanted, jnp.int32), (1,)))
  return _amax_if(x, flag, prologue, interpret=jax.default_backend() != "gpu")


@functools.partial(jax.jit, static_argnums=(2,), static_argnames=("interpret",))
def _amax_if(x, flag, prologue, *, interpret=False):
  r, c = x.shape
  grid = (r // TILE, c // TILE)
  partial = pl.pallas_call(
      functools.partial(_amax_kernel, prologue=prologue),
      out_shape=vma.shaped_like(x, grid, F32), grid=grid,
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)), interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4), name="fp8_amax_if")(flag, x)
  return _max_of_tiles(partial)


def _amax_kernel(flag_ref, x_ref, out_ref, *, prologue):
  wanted = flag_ref[0] != 0

  @pl.when(wanted)
  def _():
    out_ref[...] = jnp.full((1, 1), _tile_amax(_tile(x_ref, prologue)), F32)

  @pl.when(jnp.logical_not(wanted))
  def _():
    out_ref[...] = jnp.zeros((1, 1), F32)


def _tile_amax(x):
  """A tile's ``max(|x|)``, NaN if it holds one: Triton's max drops NaN, and the
  amax must carry it (quantize.agree makes it inf). (jnp.any has no Triton
  lowering: a max of the NaN flags instead.)"""
  nan = jnp.max(jnp.where(x != x, jnp.float32(1), jnp.float32(0))) > 0
  return jnp.where(nan, jnp.float32(jnp.nan), jnp.max(jnp.abs(x)))


def _move(x_ref, xT_ref):
  xT_ref[...] = x_ref[...].T


def _tile(x_ref, prologue):
  """The tile in float32, through `prologue` as :func:`activated` computes it."""
  return activated(x_ref[...], prologue).astype(F32)


def _cast(scale_ref, x_ref, *out_refs, limit, dtype, rows, columns, with_amax, prologue):
  x = _tile(x_ref, prologue)
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
