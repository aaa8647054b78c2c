"""Attention's layout: q, k and v, and attention's output, are ``[batch, s,
heads, head_dim]`` arrays, where the layer around them holds its tokens
``(position, batch)`` and its features ``(head, part, head_dim)`` (a QKV
projection writes q, k and v of a head side by side). XLA changes the layout
with a copy each way. An FP8 op that meets these arrays casts them where they
lie instead (:func:`cast_heads`, one read for both FP8 copies): the QKV
projection's gradients, the output projection's input. The transposed copy
then holds the tokens ``(batch, position)``, and so does the other operand
of its weight gradient (:func:`jax_comm_gemm.fp8.cast.transpose` with
`batch`). Measurements: docs/fp8.md ("Attention's layout")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import jax_comm_gemm.fp8.cast as cast
import jax_comm_gemm.fp8.quantize as qz
import jax_comm_gemm.fp8.steps as st
import jax_comm_gemm.fp8.tiles as tiles
from jax_comm_gemm import vma
from jax_comm_gemm.fp8.quantize import F32, fp8_max, saturating_cast
from jax_comm_gemm.fp8.steps import Static


def split_heads(y, parts: int, head_dim: int):
  """``y`` ``[s, b, heads * parts * head_dim]`` (columns ``(head, part,
  head_dim)``, as a QKV projection writes them) as `parts` arrays ``[b, s,
  heads, head_dim]``, attention's layout (in XLA a copy of y).

  >>> [p.shape for p in split_heads(jnp.zeros((4, 2, 3 * 8)), 3, 4)]
  [(2, 4, 2, 4), (2, 4, 2, 4), (2, 4, 2, 4)]
  """
  s, b = y.shape[:2]
  y = y.reshape(s, b, -1, parts, head_dim)
  return tuple(jnp.swapaxes(y[:, :, :, i], 0, 1) for i in range(parts))


def merge_heads(parts):
  """:func:`split_heads`' inverse: `parts` (a tuple, or one array) ``[b, s,
  heads, head_dim]`` as one ``[s, b, heads * len(parts) * head_dim]``.

  >>> merge_heads(jnp.zeros((2, 4, 3, 5))).shape
  (4, 2, 15)
  """
  parts = tuple(parts) if isinstance(parts, (tuple, list)) else (parts,)
  x = jnp.stack(parts, -2)
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], x.shape[0], -1)


def cast_heads(parts, scale, dtype, *, with_amax: bool = False,
               with_column_sums: bool = False, implementation: str = "auto"):
  """The FP8 copies of one GEMM operand held as attention's arrays, from one
  read of them: `parts` are n arrays ``[b, s, heads, head_dim]`` (the
  gradients of q, k and v, or attention's output alone) of the tensor
  ``x = stack(parts, -2)``, read as 2-D ``[s * b, heads * n * head_dim]`` with
  the tokens ``(position, batch)`` as the rest of the layer holds them.
  Returns ``(q, qT, amax, sums)``: ``q = sat(x * scale)`` ``[s * b, C]``, its
  transpose ``qT`` ``[C, b * s]`` with the tokens ``(batch, position)`` (the
  order of :func:`cast.transpose` with `batch`, which its weight gradient
  pairs it with), ``max(|x|)`` (None unless `with_amax`) and x's float32
  column sums ``[C]`` (a bias's gradient; None unless `with_column_sums`). XLA would write
  x in its layout first: a pass of its own over x's bytes, twice, at the GPU
  preset's attention. `implementation` as in :func:`cast.cast_transpose`.

  >>> q, k = jnp.ones((2, 1, 1, 2)), jnp.full((2, 1, 1, 2), 2.0)  # b=2, s=1, 1 head of 2
  >>> rows, cols, _, _ = cast_heads((q, k), 1.0, jnp.float8_e4m3fn)
  >>> rows.astype(jnp.float32).tolist(), cols.shape
  ([[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]], (4, 2))
  """
  cast.check_implementation("cast_heads", implementation)
  parts = tuple(parts) if isinstance(parts, (tuple, list)) else (parts,)
  shape = jnp.shape(parts[0])
  if len(shape) != 4 or any(jnp.shape(p) != shape for p in parts):
    raise ValueError(f"cast_heads: `parts` must be arrays of one shape [batch, tokens, "
                     f"heads, head_dim], got shapes {[jnp.shape(p) for p in parts]}")
  b, s, heads, head_dim = shape
  tr, tc, _ = cast.CAST_TILING
  if implementation == "auto":
    implementation = ("pallas" if jax.default_backend() == "gpu" and s % tr == 0
                      and head_dim % tc == 0 else "xla")
  if implementation == "xla":
    batch_major = jnp.stack(parts, -2).reshape(b * s, -1)
    rows = jnp.swapaxes(batch_major.reshape(b, s, -1), 0, 1).reshape(s * b, -1)
    return (saturating_cast(rows, scale, dtype),
            saturating_cast(batch_major.T, scale, dtype),
            cast.xla_amax(batch_major) if with_amax else None,
            jnp.sum(batch_major.astype(F32), axis=0) if with_column_sums else None)
  *parts, scale = vma.match(*parts, jnp.reshape(jnp.asarray(scale, F32), (1,)))
  return _heads(tuple(parts), scale, jnp.dtype(dtype), with_amax, with_column_sums,
                interpret=jax.default_backend() != "gpu")


@functools.partial(jax.jit, static_argnums=(2, 3, 4), static_argnames=("interpret",))
def _heads(parts, scale, dtype, with_amax, with_column_sums, *, interpret=False):
  """:func:`cast_heads`' kernel: program (i, k, j) casts the tile of positions
  i, batch element k and x's columns j, which lie in one part (a head's q, k
  or v): it reads that part's tile alone."""
  b, s, heads, head_dim = parts[0].shape
  n = len(parts)
  columns = heads * n * head_dim
  tr, tc, warps = cast.CAST_TILING
  per_head = head_dim // tc  # column tiles per head and part
  sq = pl.squeezed
  grid = (s // tr, b, columns // tc)
  x_spec = pl.BlockSpec((sq, tr, tc), lambda i, k, j: (
      k, i, (j // (n * per_head)) * per_head + j % per_head))
  outputs = [((s, b, columns), dtype, pl.BlockSpec((tr, sq, tc), lambda i, k, j: (i, k, j))),
             ((columns, b, s), dtype, pl.BlockSpec((tc, sq, tr), lambda i, k, j: (j, k, i)))]
  if with_amax:
    outputs.append((grid, F32, pl.BlockSpec((1, sq, 1), lambda i, k, j: (i, k, j))))
  if with_column_sums:  # a row of sums per program, reduced below
    outputs.append(((s // tr, b, columns), F32,
                    pl.BlockSpec((1, sq, tc), lambda i, k, j: (i, k, j))))
  load = functools.partial(_part_tile, per_head=per_head)
  kernel = functools.partial(tiles.cast_tile, load, operands=n, limit=fp8_max(dtype),
                             dtype=dtype, rows=True, columns=True, with_amax=with_amax,
                             with_column_sums=with_column_sums)
  outs = pl.pallas_call(
      kernel, out_shape=[vma.shaped_like(parts[0], shape, dt) for shape, dt, _ in outputs],
      grid=grid, in_specs=[pl.BlockSpec((1,), lambda i, k, j: (0,))] + [x_spec] * n,
      out_specs=[spec for _, _, spec in outputs], interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=warps),
      name="fp8_cast_heads_rows_columns" + ("_amax" if with_amax else "")
      + ("_sums" if with_column_sums else ""),
  )(scale, *(p.reshape(b, s, heads * head_dim) for p in parts))
  outs = iter(outs)
  rows, cols = next(outs).reshape(s * b, columns), next(outs).reshape(columns, b * s)
  amax = cast.max_of_tiles(next(outs)) if with_amax else None
  sums = jnp.sum(next(outs), axis=(0, 1)) if with_column_sums else None
  return rows, cols, amax, sums


def _part_tile(x_refs, per_head):
  """The program's tile in float32, from the one part that holds its columns
  (a branch per part: the others are not read)."""
  if len(x_refs) == 1:
    return x_refs[0][...].astype(F32)
  part = (pl.program_id(2) // per_head) % len(x_refs)
  return lax.switch(part, [lambda r=r: r[...] for r in x_refs]).astype(F32)


def project(s: Static, x8, x_inv, w8, w_inv, keep: bool, bias=None):
  """The column op's forward into attention's layout: ``(parts, g8, g_inv)``,
  the gathered FP8 rows for the weight gradient. One GEMM on the rows as
  they arrive, `bias` ``[C]`` (or None) added, its output split into the
  parts by XLA (a bf16 copy that takes the bias add with it). A GEMM per
  part writing each where attention reads it measured slower (docs/fp8.md,
  "Attention's layout"): the layout is taken inside the backward's casts."""
  parts, head_dim, batch = s.heads
  y, g8, g_inv = st.gather_gemm(s, x8, x_inv, w8, w_inv, s.x_dtype, keep=keep)
  y = y if bias is None else y + bias.astype(y.dtype)
  return split_heads(y.reshape(-1, batch, y.shape[-1]), parts, head_dim), g8, g_inv


def quantize(s: Static, parts, dtype, a, *, column_sums: bool = False):
  """Attention's arrays `parts` (:func:`cast_heads`) as one operand's FP8
  rows [s * b, C] and transposed columns [C, b * s] under the agreed amax `a`
  (one scale per tensor): ``(q, inv, qT, inv, amax seen)`` as
  :func:`steps.quantize` returns them, then with `column_sums` their float32
  column sums [C] from the same pass (a bias's gradient)."""
  scale = qz.scale_from_amax(a, dtype, s.recipe.margin)
  inv = qz.inverse(scale)
  q, qT, seen, sums = cast_heads(parts, scale, dtype, with_amax=s.recipe.scaling == "delayed",
                                 with_column_sums=column_sums, implementation=st.casts(s))
  return (q, inv, qT, inv, seen) + ((sums,) if column_sums else ())


def amax(s: Static, history, parts):
  """The amax to scale attention's arrays `parts` with: the largest of
  :func:`steps.scaling_amaxes`' for each (one scale for the tensor they make up)."""
  flat = tuple(p.reshape(-1, p.shape[-2] * p.shape[-1]) for p in parts)
  amaxes = st.scaling_amaxes(s, None if history is None else (history,) * len(parts), flat)
  return functools.reduce(jnp.maximum, amaxes)


def checked(op, name, value, recipe, tokens, features, conflict=None):
  """An FP8 op's `split_heads` ``(parts, head_dim, batch)`` or `merge_heads`
  ``(head_dim, batch)``, checked against x's `tokens` (rows) and the
  `features` they split into or merge from: ``(parts, head_dim, batch)``
  for Static.heads. `conflict`: an option given with it, which it does not
  combine with."""
  size = 3 if name == "split_heads" else 2
  if (not isinstance(value, tuple) or len(value) != size
      or not all(isinstance(v, int) and v >= 1 for v in value)):
    form = "(parts, head_dim, batch)" if size == 3 else "(head_dim, batch)"
    raise ValueError(f"{op}: `{name}` must be {form}, ints >= 1, got {value!r}")
  parts, head_dim, batch = value if size == 3 else (1,) + value
  if tokens % batch or features % (parts * head_dim):
    raise ValueError(f"{op}: `{name}` {value}: the batch must divide x's {tokens} token "
                     f"rows and parts * head_dim its {features} features")
  if not recipe.per_tensor:
    raise ValueError(f"{op}: `{name}` needs one scale per tensor ('tensor' or 'delayed' "
                     f"scaling), got {recipe.scaling!r}")
  if conflict:
    raise ValueError(f"{op}: `{name}` and `{conflict}` do not combine")
  return parts, head_dim, batch
