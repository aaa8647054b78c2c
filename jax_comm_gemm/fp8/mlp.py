"""The MLP's two FP8 ops as one ``jax.custom_vjp``: ``fp8_mlp`` is
:func:`~jax_comm_gemm.fp8.matmul.fp8_all_gather_matmul` (fc1), its bias, and
:func:`~jax_comm_gemm.fp8.matmul.fp8_matmul_reduce_scatter` with the
activation (fc2), composed from their rules' halves. fc1's bias is added
inside fc2's cast, with the activation (a GEMM's epilogue takes a bf16 bias
only). One rule for both lets the backward make fc1's output gradient,
``dh * activation'(h + b1)``, and its bias's gradient inside fc1's gradient
cast, from fc2's input gradient and the saved GEMM output: that bf16 tensor
(n x F/P) is never written, nor read again (docs/fp8.md, "Fused casts").

A gated MLP (SwiGLU, GeGLU) is the same op with a gated `activation`
(:func:`jax_comm_gemm.fp8.prologue.gated`): fc1 is gate and up, one GEMM of
``2F/P`` columns (gate's then up's), the product ``act(gate) * up`` is made
in fc2's cast from both halves of that output, and its gradient ``[d gate,
d up]`` in fc1's gradient cast, written side by side for fc1's
weight-gradient GEMM (docs/llama.md, "FP8")."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_comm_gemm.fp8.steps as st
from jax_comm_gemm.fp8.prologue import activation_gradient, flat_operands, halves, with_bias
from jax_comm_gemm import validation, vma
from jax_comm_gemm.fp8.matmul import (column_forward, column_gradients, dy_amax, row_forward,
                                      row_gradients)
from jax_comm_gemm.fp8.recipe import Fp8Recipe, check_bias, check_operands, checked_history
from jax_comm_gemm.fp8.steps import Static, xla_gather

__all__ = ["fp8_mlp"]


def fp8_mlp(x, w1, b1, w2, axis_name: str, *, activation: Callable,
            recipe: Fp8Recipe = Fp8Recipe(), keep_gathered_input: bool = False,
            reuse_gathered: bool = True, gather: Callable | None = None,
            collectives=("xla", "xla"), histories=(None, None),
            prologue: Callable | None = None):
  """The MLP's two FP8 ops, ``RS(activation(AG(x) @ w1 + b1) @ w2)``, as one
  ``jax.custom_vjp``; call inside ``jax.shard_map``. The forward is
  :func:`fp8_all_gather_matmul`, the bias, then
  :func:`fp8_matmul_reduce_scatter` with `activation` (made inside fc2's
  cast). In one rule the backward makes the gradient through the activation,
  and b1's gradient, inside the cast of fc1's output gradient: that
  gradient (bf16, ``[n, F/P]``) is never written, nor read back for the bias.

  Args:
    x: local tokens ``[n/P, ..., k]``; w1 ``[k, F/P]``; b1 ``[F/P]`` or None;
      w2 ``[F/P, k]``.
    activation: the elementwise activation (``jax.nn.gelu``, say), or a
      gated product (``prologue.gated(jax.nn.silu)``: w1 ``[k, 2F/P]`` is
      gate's columns then up's, b1 ``[2F/P]`` added to their GEMM's output,
      w2 ``[F/P, k]``).
    collectives: fc1's and fc2's, each as `collectives` in
      :func:`fp8_all_gather_matmul` and :func:`fp8_matmul_reduce_scatter`.
    histories: fc1's and fc2's :class:`AmaxHistory` (a ``"delayed"``
      recipe; their gradients are the next step's), else Nones.
    prologue: fc1's, as in :func:`fp8_all_gather_matmul` (x then the tuple
      of its operands).
    The rest as in the two ops.

  Returns:
    This rank's tokens ``[n/P, ..., k]`` in x's dtype (fc2's bias not added).

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, a, b: fp8_mlp(x, a, None, b, "tp", activation=jax.nn.relu),
  ...                   mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
  ...                   out_specs=P("tp"))
  >>> f(jnp.ones((4, 8), jnp.bfloat16), jnp.full((8, 2), 0.5), jnp.ones((2, 8))).tolist()[0]
  [8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
  """
  op = "fp8_mlp"
  validation.check_callable(op, "activation", activation)
  keep_gathered_input = validation.check_flag(op, "keep_gathered_input", keep_gathered_input)
  reuse_gathered = validation.check_flag(op, "reuse_gathered", reuse_gathered)
  xs, lead = flat_operands(op, x, prologue)
  x = xs[0]
  size = lax.axis_size(axis_name)
  tokens = x.shape[0] * size
  check_operands(op, x, w1, False, recipe, tokens)
  gated = 0 in halves(activation)
  if gated and w1.shape[1] % 2:
    raise ValueError(f"{op}: with a gated activation `w1` must be [k, 2F/P] (gate's "
                     f"columns, then up's), got shape {tuple(w1.shape)}")
  hidden = jax.ShapeDtypeStruct((tokens, w1.shape[1] // (2 if gated else 1)), x.dtype)
  check_operands(op, hidden, w2, False, recipe, tokens)
  if w2.shape[1] != x.shape[-1]:
    raise ValueError(f"{op}: `w2` must be [F/P, k] with k = x's features ({x.shape[-1]}), "
                     f"got shape {tuple(w2.shape)}")
  bias_dtype = check_bias(op, "b1", b1, w1.shape[1])
  if len(collectives) != 2 or len(histories) != 2:
    raise ValueError(f"{op}: `collectives` and `histories` take one entry per layer "
                     f"(fc1, fc2), got {len(collectives)} and {len(histories)}")
  gather = gather or xla_gather
  s1 = Static(axis_name, recipe, False, jnp.dtype(x.dtype), jnp.dtype(w1.dtype),
              keep_gathered_input=keep_gathered_input, gather=gather,
              collectives=st.checked_collectives(op, collectives[0], recipe, w1),
              prologue=prologue)
  s2 = Static(axis_name, recipe, False, jnp.dtype(x.dtype), jnp.dtype(w2.dtype),
              reuse_gathered=reuse_gathered, gather=gather,
              collectives=st.checked_collectives(op, collectives[1], recipe, w2),
              # A gated product's b1 is added to gate and up's GEMM output, not in the cast.
              prologue=activation if b1 is None or gated else with_bias(activation))
  # b1 varies with the rest: its gradient (dh's column sums) varies wherever x does.
  w1, w2, *rest = vma.varying_along(axis_name, w1, w2, *xs, *(() if b1 is None else (b1,)))
  xs, b1 = rest[:len(xs)], (rest[-1] if b1 is not None else None)
  with jax.named_scope(op):  # profiles and tests tell the one op's passes by it
    y = _mlp(tuple(xs) if prologue else xs[0], w1, b1, w2,
             checked_history(op, recipe, histories[0]),
             checked_history(op, recipe, histories[1]), (s1, s2, bias_dtype))
  return y.reshape(lead + y.shape[-1:])


# --- fp8_mlp -------------------------------------------------------------------------
# `s` is (fc1's Static, fc2's Static, b1's dtype or None).

@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _mlp(x, w1, b1, w2, h1, h2, s):
  return _mlp_fwd(x, w1, b1, w2, h1, h2, s)[0]


def _mlp_fwd(x, w1, b1, w2, h1, h2, s):
  s1, s2, _ = s
  outside = b1 if halves(s2.prologue) else None  # a gated product's: gate and up's GEMM's
  h, res1 = column_forward(x, w1, outside, h1, s1)
  # fc2's input, made inside its cast: activation(h) or activation(h + b1).
  y, res2 = row_forward(h if b1 is None or outside is not None else (h, b1), w2, h2, s2)
  return y, (res1, res2)


def _mlp_bwd(s, res, dy):
  s1, s2, bias_dtype = s
  res1, res2 = res
  dh, dw2, next2 = row_gradients(s2, res2, dy)
  # fc1's output gradient, through the activation, made inside its cast from
  # (dh, h[, b1]); with it the column sums that are b1's gradient.
  pre = res2[-1]
  operands = (dh, *pre) if isinstance(pre, tuple) else (dh, pre)
  grad = activation_gradient(s2.prologue)
  with jax.named_scope("activation"):
    dy1 = st.quantize(s1, operands, s1.recipe.backward_dtype,
                      dy_amax(s1, operands, res1[3], grad), columns=True,
                      prologue=grad, column_sums=bias_dtype is not None)
  db = None
  if bias_dtype is not None:
    dy1, db = dy1[:-1], dy1[-1].astype(bias_dtype)
  dx, dw1, next1 = column_gradients(s1, res1, dy1)
  return dx, dw1, db, dw2, next1, next2


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
