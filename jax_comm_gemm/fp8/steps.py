"""The steps the FP8 collective matmuls share: agreed amaxes, quantizing an
operand in the layouts its GEMMs want, the gathers (scales in the same call),
the reduce-scatter, the wgrad's transposed operand, the GEMM call, and the two
fused steps (AllGather+GEMM, GEMM+ReduceScatter) on XLA's collectives, the
ring (:mod:`jax_comm_gemm.ring`), or the extension's fused FP8 ops (a
:class:`~jax_comm_gemm.backends.CublasMpBackend` passed as `collectives`:
cuBLASMp's algorithms or the project's pipelined_ce; it is handed in, not
imported, so that this package stays below the backends)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import jax_comm_gemm.fp8.cast as cast
import jax_comm_gemm.fp8.quantize as qz
import jax_comm_gemm.ring as ring
from jax_comm_gemm import vma
from jax_comm_gemm.fp8.prologue import activated
from jax_comm_gemm.fp8.gemm import fp8_gemm_tn, weight_copies
from jax_comm_gemm.fp8.recipe import Fp8Recipe, pushed, scaling_amax

FUSED_SCOPE = "jax_comm_gemm.fp8.gather_for_gemm"
COLLECTIVES = ("xla", "ring")
STANDALONE_SCOPE = "jax_comm_gemm.all_gather"


def xla_gather(tree, axis_name: str):
  """``lax.all_gather`` of every array in `tree` along axis 0, in one call.

  >>> import numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> jax.shard_map(lambda a: xla_gather((a,), "tp")[0], mesh=mesh, in_specs=P("tp"),
  ...               out_specs=P("tp"))(jax.numpy.ones((2, 3))).shape
  (2, 3)
  """
  return lax.all_gather(tree, axis_name, axis=0, tiled=True)


@dataclasses.dataclass(frozen=True)
class Static:
  """The non-differentiable arguments of the custom_vjp rules."""
  axis_name: str
  recipe: Fp8Recipe
  transpose_w: bool
  x_dtype: Any
  w_dtype: Any
  keep_gathered_input: bool = False
  return_gathered: bool = False
  reuse_gathered: bool = True
  gather: Callable = xla_gather
  # The fused steps' collectives: one of COLLECTIVES, or a CublasMpBackend
  # (the extension's fused FP8 ops; one scale per tensor).
  collectives: Any = "xla"
  # An elementwise function that the op applies to x first, inside x's cast
  # (:mod:`.prologue`: a LayerNorm's normalization, the MLP's activation): its
  # output is never written in bf16.
  prologue: Callable | None = None
  # (parts, head_dim, batch) where the op's token-side operand is held as
  # attention's arrays [batch, tokens, heads, head_dim] (the column op's output
  # in `parts`, the row op's input): heads.cast_heads makes their FP8 copies.
  heads: tuple | None = None
  # The dtype of the column op's bias, or None (its gradient: dy's column sums).
  bias: Any = None


# Hopper's FP8 tensor cores read rows of 16-byte multiples.
FUSED_ALIGNMENT = 16


def why_not_fused(recipe: Fp8Recipe, w_shape) -> str | None:
  """Why the extension's fused FP8 ops cannot run `recipe` with a local w of
  `w_shape`, or None: they take one scale per tensor and w's dims in multiples
  of 16 (what the op refuses, and what ``auto`` does not measure)."""
  if not recipe.per_tensor:
    return (f"the extension's fused FP8 ops take one scale per tensor ('tensor' or "
            f"'delayed' scaling); {recipe.scaling!r} scaling runs on collectives 'xla' or "
            f"'ring'")
  if any(d % FUSED_ALIGNMENT for d in w_shape):
    return (f"the extension's fused FP8 ops need w's dims to be multiples of "
            f"{FUSED_ALIGNMENT} (Hopper's FP8 GEMMs), got w {tuple(w_shape)}; collectives "
            f"'xla' or 'ring' take any shape")
  return None


def checked_collectives(op: str, collectives, recipe: Fp8Recipe, w):
  """`collectives`, checked: one of ``steps.COLLECTIVES``, or the extension's
  fused FP8 ops (a CublasMpBackend) where they can run (:func:`why_not_fused`)."""
  if isinstance(collectives, str) and collectives in COLLECTIVES:
    return collectives
  # A Backend declares whether it has them (base.py); this package sits below
  # the backends, so it asks the declaration rather than the class.
  if not getattr(collectives, "fp8_fused_ops", False):
    raise ValueError(f"{op}: `collectives` must be one of {COLLECTIVES} or a "
                     f"jax_comm_gemm.backends.CublasMpBackend (the extension's fused FP8 "
                     f"ops), got {collectives!r}")
  why = why_not_fused(recipe, w.shape)
  if why is not None:
    raise ValueError(f"{op}: {why}")
  return collectives


def fused_ops(s: Static):
  """The extension's fused FP8 ops (a CublasMpBackend), or None."""
  return None if isinstance(s.collectives, str) else s.collectives


def scaling_amaxes(s: Static, histories, xs, prologues=None):
  """The amaxes to scale `xs` with, one per tensor, agreed in one pmax (Nones
  for per-row and block scales): "tensor": this step's; "delayed": each of
  `histories`' largest, and this step's while a history is empty (the first
  step scales as "tensor" does; later steps read no tensor here: the amax
  their histories record comes from the cast's pass, :func:`next_history`).
  `prologues`: per x, None or the elementwise function whose output is cast
  (the amax is of that output, computed in the same read of x)."""
  if not s.recipe.per_tensor:
    return (None,) * len(xs)
  prologues = prologues or (None,) * len(xs)
  if s.recipe.scaling != "delayed":  # XLA fuses the prologue into the reduction
    return qz.agree(tuple(qz.amax(activated(x, f)) for x, f in zip(xs, prologues)),
                    s.axis_name)
  empty = tuple(jnp.max(h) == 0 for h in histories)
  currents = qz.agree(tuple(cast.amax_if(x, e, implementation=casts(s), prologue=f)
                            for x, e, f in zip(xs, empty, prologues)), s.axis_name)
  return tuple(scaling_amax(h, a) for h, a in zip(histories, currents))


def next_history(s: Static, history, seen):
  """`history` with `seen`, this rank's amax from the cast's pass, in front:
  agreed over the group and every replica. None without a history."""
  if history is None:
    return None
  return pushed(history, _everywhere(qz.agree(seen, s.axis_name)))


def _everywhere(a):
  """`a` maxed over every mesh axis it still varies on (a data axis, say): a
  history is one array for all replicas, and its next value must be too (a
  varying one would be summed over the replicas on its way out)."""
  axes = tuple(sorted(vma.varying_axes(a)))
  return lax.pmax(a, axes) if axes else a


def quantize(s: Static, x, dtype, a, *, rows: bool = True, columns: bool = False,
             prologue=None, column_sums: bool = False):
  """x [r, c] as FP8 rows (q, inv) and/or transposed columns (qT [c, r], inv),
  then x's amax as the cast's pass saw it (for "delayed"'s history; else
  None): with the agreed amax `a` (one scale per tensor), per row / per
  column ("row"), or per 1 x 128 block along the rows / the columns ("block":
  the blocks run along the contraction of the GEMM each copy feeds).
  `prologue`: the elementwise function whose output ``prologue(x)`` is
  quantized, applied in the cast's pass (:func:`.prologue.activated`; x a tuple
  of its operands where it takes several). `column_sums`: also return, last,
  the float32 column sums of what is quantized (a bias's gradient), from the
  same pass."""
  out = []
  if s.recipe.per_tensor:
    scale = qz.scale_from_amax(a, dtype, s.recipe.margin)
    inv = qz.inverse(scale)
    # The cast writes the transposed copy: no FP8 transpose.
    q, qT, seen, *sums = cast.cast_transpose(x, scale, dtype, rows=rows, columns=columns,
                                             with_amax=s.recipe.scaling == "delayed",
                                             implementation=casts(s), prologue=prologue,
                                             with_column_sums=column_sums)
    if rows:
      out += [q, inv]
    if columns:
      out += [qT, inv]
    return out + [seen] + sums
  x = activated(x, prologue)  # XLA fuses it into the per-row / block casts
  sums = [jnp.sum(x.astype(jnp.float32), axis=0)] if column_sums else []
  if s.recipe.scaling == "block":
    if rows:
      out += list(qz.quantize_blocks(x, dtype, 1, margin=s.recipe.margin))
    if columns:
      out += list(qz.quantize_blocks(x.T, dtype, 1, margin=s.recipe.margin))
    return out + [None] + sums
  if rows:
    out += list(qz.quantize_rows(x, dtype, margin=s.recipe.margin))
  if columns:
    out += list(qz.quantize_columns_transposed(x, dtype, margin=s.recipe.margin))
  return out + [None] + sums


def gather(s: Static, q, inv, *, standalone: bool):
  """The FP8 rows of every rank, with their scales if per row (same call)."""
  if lax.axis_size(s.axis_name) == 1:
    return q, inv
  tree = (q,) if s.recipe.per_tensor else (q, inv)
  if standalone:
    with jax.named_scope(STANDALONE_SCOPE):
      out = xla_gather(tree, s.axis_name)
  else:
    with jax.named_scope(FUSED_SCOPE):
      out = s.gather(tree, s.axis_name)
  return (out[0], inv) if s.recipe.per_tensor else (out[0], out[1])


def reduce_scatter(s: Static, y):
  if lax.axis_size(s.axis_name) == 1:
    return y
  return lax.psum_scatter(y, s.axis_name, scatter_dimension=0, tiled=True)


def transposed(s: Static, g8, g_inv, dtype):
  """Gathered FP8 rows [n, c] as the TN operand [c, n] of a GEMM over tokens:
  the same bytes under the same scale ("tensor", exact), or dequantized and
  requantized per column ("row": per-token scales cannot factor out) or per
  1 x 128 block along the tokens ("block")."""
  if s.recipe.per_tensor:
    batch = s.heads[2] if s.heads else 1
    return cast.transpose(g8, batch=batch, implementation=casts(s)), g_inv
  if s.recipe.scaling == "block":
    return qz.quantize_blocks(qz.dequantize(g8, g_inv).T, dtype, 1, margin=s.recipe.margin)
  return qz.quantize_columns_transposed(qz.dequantize(g8, g_inv), dtype,
                                        margin=s.recipe.margin)


def casts(s: Static) -> str:
  """:mod:`jax_comm_gemm.fp8.cast`'s implementation for the recipe's casts."""
  return "auto" if s.recipe.casts == "fused" else "xla"


def fast_accumulation(s: Static, gradient: bool) -> bool:
  """Whether a GEMM of the layer (`gradient`: dx or dw) accumulates fast."""
  return {"fast": True, "fast_forward": not gradient, "precise": False}[s.recipe.accumulation]


def gemm(s: Static, a8, b8, ia, ib, out_dtype, *, gradient: bool = False):
  """A GEMM of the layer: its forward, or (`gradient`) dx or dw."""
  return fp8_gemm_tn(a8, b8, ia, ib, out_dtype, form=s.recipe.gemm_form,
                     fast_accum=fast_accumulation(s, gradient))


def gather_gemm(s: Static, q8, inv, b8, b_inv, out_dtype, *, gradient: bool = False,
                keep: bool = True):
  """The fused AllGather+GEMM, ``AG(q8) . b8``: ``(y, g8, g_inv)``, with the
  gathered FP8 operand (and its scales) for the weight gradient to reuse
  (`keep`: it will be used; XLA drops an unused one, the extension's ops are
  asked for it only then)."""
  def gemm_with(a8, ia):
    return gemm(s, a8, b8, ia, b_inv, out_dtype, gradient=gradient)
  fused = fused_ops(s)
  if fused is not None and lax.axis_size(s.axis_name) > 1:
    with jax.named_scope(FUSED_SCOPE):
      y, g8 = fused.fp8_all_gather_matmul(q8, b8, inv, b_inv, s.axis_name,
                                          out_dtype=out_dtype,
                                          fast_accum=fast_accumulation(s, gradient),
                                          return_gathered=keep)
    if g8 is None and keep:  # the op could not hand it out: gather again
      g8, _ = gather(s, q8, inv, standalone=True)
    return y, g8, inv
  if s.collectives == "ring" and lax.axis_size(s.axis_name) > 1:
    with jax.named_scope(FUSED_SCOPE):
      return ring.all_gather_gemm(q8, inv, gemm_with, s.axis_name,
                                  row_scales=not s.recipe.per_tensor)
  g8, g_inv = gather(s, q8, inv, standalone=False)
  return gemm_with(g8, g_inv), g8, g_inv


def gemm_reduce_scatter(s: Static, a8, ia, b8, ib, out_dtype, *, gradient: bool = False):
  """The fused GEMM+ReduceScatter, ``RS(a8 . b8)`` along the tokens."""
  def gemm_with(part8, inv):
    return gemm(s, part8, b8, inv, ib, out_dtype, gradient=gradient)
  collectives, fused = s.collectives, fused_ops(s)
  if fused is not None:  # its reduce_scatter: "xla", "ring" or an algorithm
    collectives = fused.reduce_scatter
    if collectives not in COLLECTIVES and lax.axis_size(s.axis_name) > 1:
      return fused.fp8_matmul_reduce_scatter(a8, b8, ia, ib, s.axis_name,
                                             out_dtype=out_dtype,
                                             fast_accum=fast_accumulation(s, gradient))
  if collectives == "ring" and lax.axis_size(s.axis_name) > 1:
    return ring.gemm_reduce_scatter(a8, ia, gemm_with, s.axis_name,
                                    row_scales=not s.recipe.per_tensor)
  return reduce_scatter(s, gemm_with(a8, ia))


def weight_gradient(s: Static, xT8, xT_inv, dyT8, dyT_inv):
  """w [k, m]: dw = x.T @ dy;  w [m, k]: dw = dy.T @ x (TN operands [k|m, n]).
  The GEMM writes it in the computation dtype (x's), as a GEMM of x's dtype
  would: a float32 master weight's gradient is converted where it is read
  (XLA fuses the conversion into the optimizer's update), not written and
  read in float32 (docs/fp8.md, "Training")."""
  a, b, ia, ib = (dyT8, xT8, dyT_inv, xT_inv) if s.transpose_w else (xT8, dyT8, xT_inv, dyT_inv)
  return gemm(s, a, b, ia, ib, s.x_dtype, gradient=True).astype(s.w_dtype)


def weights(s: Static, w, amax_w):
  """The weight's two FP8 copies with their inverse scales, then w's amax as
  the cast's pass saw it ("delayed"; else None)."""
  r, delayed = s.recipe, s.recipe.scaling == "delayed"
  copies = weight_copies(w, r.forward_dtype, scaling="tensor" if r.per_tensor else r.scaling,
                         transpose_w=s.transpose_w, margin=r.margin, amax_w=amax_w,
                         casts=casts(s), with_amax=delayed)
  return copies if delayed else copies + (None,)
