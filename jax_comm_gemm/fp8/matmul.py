"""FP8 collective matmuls, inside ``jax.shard_map``: ``fp8_all_gather_matmul``
(``AG(x) @ w``, column-parallel) and ``fp8_matmul_reduce_scatter``
(``RS(x @ w)``, row-parallel), each a ``jax.custom_vjp`` of FP8 GEMMs in the TN
form (:mod:`jax_comm_gemm.fp8.gemm`), with FP8 bytes on the wire::

  column  fwd  y  = AG(x8) . w8_fwd                  gathered x8 kept if asked
          bwd  dx = RS(dy8 . w8_bwd)    dw = AG(x8).T . dy8   (x8 re-gathered,
                                                       or the kept one)
  row     fwd  y  = RS(x8 . w8_fwd)
          bwd  dx = AG(dy8) . w8_bwd    dw = x8.T . AG(dy8)   (the SAME gathered
                                                       dy8: one all-gather)

The gathers that feed a GEMM run under :data:`FUSED_SCOPE`, a re-gather under
:data:`STANDALONE_SCOPE`; the fused steps live in :mod:`jax_comm_gemm.fp8.steps`.
Why: docs/fp8.md#on-the-wire-and-the-reuse."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_comm_gemm import validation, vma
import jax_comm_gemm.fp8.quantize as qz
import jax_comm_gemm.fp8.steps as st
from jax_comm_gemm.fp8.prologue import (activated, activation_gradient, check_not_gated,
                                        flat_operands, gradients)
import jax_comm_gemm.fp8.heads as heads
from jax_comm_gemm.fp8.recipe import (AmaxHistory, Fp8Recipe, check_bias, check_operands,
                                      checked_history)
from jax_comm_gemm.fp8.steps import FUSED_SCOPE, STANDALONE_SCOPE, Static, xla_gather

__all__ = ["FUSED_SCOPE", "STANDALONE_SCOPE", "fp8_all_gather_matmul",
           "fp8_matmul_reduce_scatter", "xla_gather"]


def fp8_all_gather_matmul(x, w, axis_name: str, *, recipe: Fp8Recipe = Fp8Recipe(),
                          transpose_w: bool = False, keep_gathered_input: bool = False,
                          return_gathered: bool = False, gather: Callable | None = None,
                          collectives="xla", history: AmaxHistory | None = None,
                          prologue: Callable | None = None,
                          split_heads: tuple[int, int, int] | None = None, bias=None):
  """``all_gather(x) @ w + bias`` along tokens (axis 0) with FP8 GEMMs; call inside
  ``jax.shard_map``.

  Args:
    x: local tokens ``[n/P, ..., k]`` (bf16, f16 or f32; leading dims fold
      into the tokens); with `prologue`, the tuple of its operands.
    w: local weight ``[k, m]``, or ``[m, k]`` with `transpose_w`.
    axis_name: the tensor-parallel axis (size P).
    recipe: the :class:`Fp8Recipe`.
    keep_gathered_input: keep the gathered FP8 x for the weight gradient
      instead of all-gathering it again in the backward.
    return_gathered: also return the gathered x as the GEMM saw it
      (dequantized, in x's dtype).
    gather: ``gather(tree, axis_name)`` for the gathers that feed a GEMM
      (default :func:`xla_gather`).
    collectives: ``"xla"``, ``"ring"`` (:mod:`jax_comm_gemm.ring`), or a
      :class:`~jax_comm_gemm.backends.CublasMpBackend` (the extension's fused
      FP8 ops: a connected axis, one scale per tensor, w's dims multiples of 16).
    history: the :class:`AmaxHistory` of a ``"delayed"`` recipe (its gradient
      is the next step's history); None for the other recipes.
    prologue: an elementwise function (:mod:`.prologue`: a LayerNorm's
      normalization) whose output is the op's input, made inside x's FP8 cast:
      x is then the tuple of its operands (x first; the others of its shape,
      ``[k]`` or ``[n/P, ..., 1]``), each of which gets its gradient.
    split_heads: ``(parts, head_dim, batch)``: y in attention's layout, as
      `parts` arrays ``[batch, n, heads, head_dim]`` of its columns ``(heads,
      parts, head_dim)``, x's tokens being ``(position, batch)``; their
      gradients are cast where they lie (:mod:`jax_comm_gemm.fp8.heads`).
    bias: None, or ``[m]`` (a float dtype) added to y; its gradient, y's
      gradient's column sums, comes in float32 from that gradient's cast.

  Returns:
    ``y`` ``[n, ..., m]`` in x's dtype, or ``(y, gathered_x)``, or with
    `split_heads` the tuple of its parts.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: fp8_all_gather_matmul(x, w, "tp"), mesh=mesh,
  ...                   in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  >>> f(jnp.ones((4, 8), jnp.bfloat16), jnp.full((8, 2), 0.5)).tolist()
  [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
  """
  op = "fp8_all_gather_matmul"
  transpose_w = validation.check_flag(op, "transpose_w", transpose_w)
  keep_gathered_input = validation.check_flag(op, "keep_gathered_input", keep_gathered_input)
  return_gathered = validation.check_flag(op, "return_gathered", return_gathered)
  xs, lead = flat_operands(op, x, prologue)
  size = lax.axis_size(axis_name)
  check_operands(op, xs[0], w, transpose_w, recipe, xs[0].shape[0] * size)
  layout = None if split_heads is None else heads.checked(
      op, "split_heads", split_heads, recipe, xs[0].shape[0], w.shape[0 if transpose_w else 1],
      "return_gathered" if return_gathered else None)
  s = Static(axis_name, recipe, transpose_w, jnp.dtype(xs[0].dtype), jnp.dtype(w.dtype),
              keep_gathered_input=keep_gathered_input,
              return_gathered=return_gathered, gather=gather or xla_gather,
              collectives=st.checked_collectives(op, collectives, recipe, w),
              prologue=prologue, heads=layout,
              bias=check_bias(op, "bias", bias, w.shape[0 if transpose_w else 1]))
  # A bias varies with the rest: its gradient varies wherever x does.
  w, *rest = vma.varying_along(axis_name, w, *xs, *(() if bias is None else (bias,)))
  xs, bias = rest[:len(xs)], (rest[-1] if bias is not None else None)
  out = _all_gather_matmul(tuple(xs) if prologue else xs[0], w, bias,
                           checked_history(op, recipe, history), s)
  if layout is not None:
    return out
  unfold = lambda t: t.reshape((lead[0] * size,) + lead[1:] + t.shape[-1:])
  return (unfold(out[0]), unfold(out[1])) if return_gathered else unfold(out)


def fp8_matmul_reduce_scatter(x, w, axis_name: str, *, recipe: Fp8Recipe = Fp8Recipe(),
                              transpose_w: bool = False, reuse_gathered: bool = True,
                              gather: Callable | None = None, collectives="xla",
                              history: AmaxHistory | None = None,
                              activation: Callable | None = None,
                              merge_heads: tuple[int, int] | None = None):
  """``reduce_scatter(x @ w)`` along tokens (axis 0) with FP8 GEMMs; call inside
  ``jax.shard_map``. x: all tokens, local features, ``[n, ..., k/P]``; w
  ``[k/P, m]`` (``[m, k/P]`` with `transpose_w`); `reuse_gathered`: the weight
  gradient reads the FP8 dy that the input gradient's AllGather+GEMM gathered
  (False: gathers it again); `activation`: an elementwise function applied to
  x first inside x's FP8 cast (recomputed by the backward); `merge_heads`
  ``(head_dim, batch)``: x is attention's output ``[batch, n, heads,
  head_dim]`` as ``[batch * n, heads * head_dim]``, cast where it lies
  (:mod:`jax_comm_gemm.fp8.heads`); the rest as in :func:`fp8_all_gather_matmul`.
  Returns this rank's tokens of the sum, ``[n/P, ..., m]``, in x's dtype.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: fp8_matmul_reduce_scatter(x, w, "tp"), mesh=mesh,
  ...                   in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> f(jnp.ones((4, 8)), jnp.full((8, 2), 0.25)).round(4).tolist()
  [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
  """
  op = "fp8_matmul_reduce_scatter"
  transpose_w = validation.check_flag(op, "transpose_w", transpose_w)
  reuse_gathered = validation.check_flag(op, "reuse_gathered", reuse_gathered)
  if activation is not None:
    validation.check_callable(op, "activation", activation)
    check_not_gated(op, activation)
  check_operands(op, x, w, transpose_w, recipe, int(np.prod(x.shape[:-1])))
  layout = None if merge_heads is None else heads.checked(
      op, "merge_heads", merge_heads, recipe, int(np.prod(x.shape[:-1])), x.shape[-1],
      "activation" if activation is not None else None)
  size = lax.axis_size(axis_name)
  positions = x.shape[0] // (1 if layout is None else layout[2])
  if positions % size:
    raise ValueError(f"{op}: x's tokens ({positions} positions) must be divisible by the "
                     f"size of axis {axis_name!r} ({size})")
  s = Static(axis_name, recipe, transpose_w, jnp.dtype(x.dtype), jnp.dtype(w.dtype),
              reuse_gathered=reuse_gathered, gather=gather or xla_gather,
              collectives=st.checked_collectives(op, collectives, recipe, w),
              prologue=activation, heads=layout)
  y = _matmul_reduce_scatter(*vma.varying_along(axis_name, x.reshape(-1, x.shape[-1]), w),
                             checked_history(op, recipe, history), s)
  return y.reshape((x.shape[0] // size,) + x.shape[1:-1] + y.shape[-1:])


# --- fp8_all_gather_matmul ------------------------------------------------------
# `h` is the AmaxHistory of a "delayed" recipe, else None; its cotangent is the
# next step's history (AmaxHistory's docstring).

@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _all_gather_matmul(x, w, b, h, s: Static):
  return column_forward(x, w, b, h, s)[0]


def _operands(s: Static, x, w, h):
  """x's amax to scale with, the weight's two FP8 copies (forward, backward)
  with their inverse scales, and w's next history (delayed; else None)."""
  ax, aw = st.scaling_amaxes(s, (h.x, h.w) if h is not None else None, (x, w),
                             prologues=(s.prologue, None))
  wf8, wf_inv, wb8, wb_inv, w_seen = st.weights(s, w, aw)
  return ax, (wf8, wf_inv, wb8, wb_inv), st.next_history(s, None if h is None else h.w, w_seen)


def dy_amax(s: Static, dy, h, prologue=None):
  """dy's amax to scale with (of ``prologue(*dy)`` where one is given)."""
  (a_dy,) = st.scaling_amaxes(s, (h.dy,) if h is not None else None, (dy,),
                              prologues=(prologue,))
  return a_dy


def column_forward(x, w, bias, h, s: Static):
  ax, (wf8, wf_inv, wb8, wb_inv), hw = _operands(s, x, w, h)
  x8, x_inv, x_seen = st.quantize(s, x, s.recipe.forward_dtype, ax, prologue=s.prologue)
  hx = st.next_history(s, None if h is None else h.x, x_seen)
  keep = s.keep_gathered_input or s.return_gathered
  if s.heads is not None:  # q, k and v in attention's layout
    out, g8, g_inv = heads.project(s, x8, x_inv, wf8, wf_inv, keep, bias)
  else:
    y, g8, g_inv = st.gather_gemm(s, x8, x_inv, wf8, wf_inv, s.x_dtype, keep=keep)
    y = y if bias is None else y + bias.astype(y.dtype)
    out = (y, qz.dequantize(g8, g_inv, s.x_dtype)) if s.return_gathered else y
  pre = x if s.prologue is not None else None  # the backward's vjp recomputes from it
  return out, ((g8, g_inv) if keep else (x8, x_inv), wb8, wb_inv, h, hx, hw, pre)


def _all_gather_matmul_bwd(s: Static, res, ct):
  h, sums = res[3], s.bias is not None  # the bias's gradient: dy's column sums
  if s.heads is not None:  # ct: the parts' gradients, cast from where they lie
    a = heads.amax(s, None if h is None else h.dy, ct)
    dy, ct_g = heads.quantize(s, ct, s.recipe.backward_dtype, a, column_sums=sums), None
  else:
    ct_y, ct_g = ct if s.return_gathered else (ct, None)
    dy = st.quantize(s, ct_y, s.recipe.backward_dtype, dy_amax(s, ct_y, h), columns=True,
                     column_sums=sums)
  db = dy[-1].astype(s.bias) if sums else None
  dx, dw, histories = column_gradients(s, res, dy[:5], ct_g)
  return dx, dw, db, histories


def column_gradients(s: Static, res, dy, ct_g=None):
  """(dx, dw, next histories) from the output gradient's FP8 copies `dy`
  ``(dy8, inv, dyT8, inv, amax seen)``; with a prologue dx is the tuple of its
  operands' gradients."""
  (o8, o_inv), wb8, wb_inv, h, hx, hw, pre = res
  dy8, dy_inv, dyT8, dyT_inv, dy_seen = dy
  dx = st.gemm_reduce_scatter(s, dy8, dy_inv, wb8, wb_inv, s.x_dtype, gradient=True)
  if s.keep_gathered_input or s.return_gathered:
    g8, g_inv = o8, o_inv
  else:
    g8, g_inv = st.gather(s, o8, o_inv, standalone=True)
  xT8, xT_inv = st.transposed(s, g8, g_inv, s.recipe.forward_dtype)
  dw = st.weight_gradient(s, xT8, xT_inv, dyT8, dyT_inv)
  if ct_g is not None:
    dx = dx + st.reduce_scatter(s, ct_g).astype(s.x_dtype)
  if pre is not None:  # through the prologue, recomputed (XLA fuses it)
    dx = gradients(pre, s.prologue, dx)
  return dx, dw, _next(s, h, hx, hw, dy_seen)


def _next(s: Static, h, hx, hw, dy_seen):
  """The histories' cotangent: the next step's AmaxHistory (None without one)."""
  return None if h is None else AmaxHistory(hx, hw, st.next_history(s, h.dy, dy_seen))


_all_gather_matmul.defvjp(column_forward, _all_gather_matmul_bwd)


# --- fp8_matmul_reduce_scatter ----------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul_reduce_scatter(x, w, h, s: Static):
  return row_forward(x, w, h, s)[0]


def row_forward(x, w, h, s: Static):
  ax, (wf8, wf_inv, wb8, wb_inv), hw = _operands(s, x, w, h)
  # x [n, k/P] holds every token: its column-scaled transposed copy (the
  # weight gradient's operand) comes from the same cast.
  if s.heads is not None:  # x: attention's output, cast from where it lies
    _, head_dim, batch = s.heads
    parts = (x.reshape(batch, -1, x.shape[1] // head_dim, head_dim),)
    x8, x_inv, xT8, xT_inv, x_seen = heads.quantize(s, parts, s.recipe.forward_dtype, ax)
  else:
    x8, x_inv, xT8, xT_inv, x_seen = st.quantize(s, x, s.recipe.forward_dtype, ax,
                                                 columns=True, prologue=s.prologue)
  hx = st.next_history(s, None if h is None else h.x, x_seen)
  y = st.gemm_reduce_scatter(s, x8, x_inv, wf8, wf_inv, s.x_dtype)
  pre = x if s.prologue is not None else None  # the backward recomputes from it
  return y, (xT8, xT_inv, wb8, wb_inv, h, hx, hw, pre)


def _matmul_reduce_scatter_bwd(s: Static, res, dy):
  dx, dw, histories = row_gradients(s, res, dy)
  if s.heads is not None:  # back to attention's layout
    _, head_dim, batch = s.heads
    (dx,) = heads.split_heads(dx.reshape(-1, batch, dx.shape[-1]), 1, head_dim)
    dx = dx.reshape(-1, dx.shape[2] * head_dim)
  pre = res[-1]
  if pre is not None:  # through the activation, recomputed (XLA fuses it)
    with jax.named_scope("activation"):
      dx = activated((dx, pre), activation_gradient(s.prologue))
  return dx, dw, histories


def row_gradients(s: Static, res, dy):
  """(dx, dw, next histories), dx the gradient of the activation's output
  where the op applies one."""
  xT8, xT_inv, wb8, wb_inv, h, hx, hw, _ = res
  b8 = s.recipe.backward_dtype
  dy8, dy_inv, dy_seen = st.quantize(s, dy, b8, dy_amax(s, dy, h))
  dx, g8, g_inv = st.gather_gemm(s, dy8, dy_inv, wb8, wb_inv, s.x_dtype, gradient=True,
                                 keep=s.reuse_gathered)
  if not s.reuse_gathered:
    g8, g_inv = st.gather(s, dy8, dy_inv, standalone=True)
  dyT8, dyT_inv = st.transposed(s, g8, g_inv, b8)
  dw = st.weight_gradient(s, xT8, xT_inv, dyT8, dyT_inv)
  return dx, dw, _next(s, h, hx, hw, dy_seen)


_matmul_reduce_scatter.defvjp(row_forward, _matmul_reduce_scatter_bwd)
