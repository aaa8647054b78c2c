"""Differentiable collective matmuls along tokens, inside shard_map: ``all_gather_matmul``
(``AG(x) @ w``) and ``matmul_reduce_scatter`` (``RS(x @ w)``), each a ``jax.custom_vjp``
whose backward runs the other op for the input gradient. How both run is one value
decided where the op is called, under the plan passed in: ``routes.op_route``'s
:class:`OpRoute` (each op's backend, bound to that plan, and where each weight
gradient's gathered operand comes from: the AllGather+GEMM where the self-test lets it
hand it out, else ``lax.all_gather``). With ``config.fp8``: :mod:`jax_comm_gemm.fp8`."""

from __future__ import annotations

import dataclasses
import warnings
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_comm_gemm import validation, vma
from jax_comm_gemm.backends import Backend, all_gather_tokens
from jax_comm_gemm.backends.routes import AG, RS, OpRoute, fp8_collectives, fp8_route, given
from jax_comm_gemm.backends.routes import op_route
from jax_comm_gemm.backends.xla import weight_gradient
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig, check_config
from jax_comm_gemm.fp8 import fp8_all_gather_matmul, fp8_matmul_reduce_scatter, fp8_mlp
from jax_comm_gemm.fp8.prologue import scoped
from jax_comm_gemm.runtime.registry import current_plan


@dataclasses.dataclass(frozen=True)
class _Static:
  """The non-differentiable arguments of both custom_vjp rules."""
  axis_name: str
  transpose_w: bool
  route: OpRoute  # decided once, at the call (backends/routes.py)
  return_gathered: bool = False
  keep_gathered_input: bool = False
  precision: Any = None
  plan: Any = None  # the plan that decided `route`: the jits below key on it


def all_gather_matmul(x, w, axis_name: str, *, transpose_w: bool = False,
                      return_gathered: bool = False, keep_gathered_input: bool = False,
                      precision=None, config: CommGemmConfig = DEFAULT_CONFIG,
                      fp8_history=None):
  """``all_gather(x) @ w`` along tokens (axis 0); call inside ``jax.shard_map``.

  Args:
    x: local tokens, ``[n/P, k]``.
    w: local weight, ``[k, m]`` (Flax layout), or ``[m, k]`` with ``transpose_w``.
    axis_name: the tensor-parallel mesh axis (size P) to gather over.
    return_gathered: also return the gathered ``x``, ``[n, k]``.
    keep_gathered_input: keep the gathered ``x`` for the weight gradient
      instead of gathering it again in the backward pass (N*K memory).
    precision: as ``lax.dot_general`` takes it, for every GEMM; refused where it
      would be ignored (FP8, backend "cublasmp"); "auto" runs it on XLA.
    config: backend and algorithm choices.
    fp8_history: a ``"delayed"`` recipe's AmaxHistory; its gradient: the next.

  Returns:
    ``y`` of shape ``[n, m]``, or ``(y, gathered_x)``.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.jit(jax.shard_map(lambda x, w: all_gather_matmul(x, w, "tp"), mesh=mesh,
  ...                           in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).shape
  (4, 2)
  """
  op = "all_gather_matmul"
  check_config(op, config)
  transpose_w = validation.check_flag(op, "transpose_w", transpose_w)
  return_gathered = validation.check_flag(op, "return_gathered", return_gathered)
  keep_gathered_input = validation.check_flag(op, "keep_gathered_input", keep_gathered_input)
  validation.bound_axis_size(op, axis_name)
  validation.check_matmul(op, x, w, transpose_w=transpose_w)
  return all_gather_matmul_unchecked(
      x, w, axis_name, transpose_w=transpose_w, return_gathered=return_gathered,
      keep_gathered_input=keep_gathered_input, precision=precision, config=config,
      fp8_history=fp8_history, plan=current_plan())  # an entry: read once, passed down


def matmul_reduce_scatter(x, w, axis_name: str, *, transpose_w: bool = False,
                          precision=None, config: CommGemmConfig = DEFAULT_CONFIG,
                          fp8_history=None):
  """``reduce_scatter(x @ w)`` along tokens (axis 0); call inside ``jax.shard_map``.
  x: all tokens, local features, ``[n, k/P]``; w: ``[k/P, m]``, or ``[m, k/P]``
  with ``transpose_w``; the other arguments as in :func:`all_gather_matmul`.
  Returns this shard's tokens of the summed product, ``[n/P, m]``.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.jit(jax.shard_map(lambda x, w: matmul_reduce_scatter(x, w, "tp"), mesh=mesh,
  ...                           in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).shape
  (4, 2)
  """
  op = "matmul_reduce_scatter"
  check_config(op, config)
  transpose_w = validation.check_flag(op, "transpose_w", transpose_w)
  size = validation.bound_axis_size(op, axis_name)
  validation.check_matmul(op, x, w, transpose_w=transpose_w)
  validation.check_divisible(op, "x", "tokens", x.shape[0], axis_name, size)
  return matmul_reduce_scatter_unchecked(x, w, axis_name, transpose_w=transpose_w,
                                         precision=precision, config=config,
                                         fp8_history=fp8_history, plan=current_plan())


def all_gather_matmul_unchecked(x, w, axis_name, *, transpose_w, return_gathered,
                                keep_gathered_input, precision, config, fp8_history=None,
                                prologue=None, split_heads=None, bias=None, plan):
  """:func:`all_gather_matmul` for callers that validated the arguments, of
  ``prologue(*x)`` where one is given (an elementwise function of the tuple x,
  :mod:`jax_comm_gemm.fp8.prologue`: the FP8 op applies it inside x's cast),
  plus `bias` (None or ``[m]``; inside the FP8 op, whose gradient cast sums it), under
  `plan`, the routing plan its caller's entry read (None is an error, not a read)."""
  precision = validation.check_op_options("all_gather_matmul", config, fp8_history, precision)
  plan = given(plan, "all_gather_matmul_unchecked")
  if fp8_route(config, plan).fp8:
    gathered = return_gathered or keep_gathered_input
    first = x[0] if prologue is not None else x
    collectives = fp8_collectives(config, AG, first, w, transpose_w, axis_name, gathered, plan)
    return fp8_all_gather_matmul(
        x, w, axis_name, recipe=config.fp8, transpose_w=transpose_w, history=fp8_history,
        keep_gathered_input=keep_gathered_input, return_gathered=return_gathered,
        collectives=collectives[0], prologue=prologue, split_heads=split_heads, bias=bias)
  x = scoped(x, prologue)
  route = op_route(config, AG, x, w, transpose_w, axis_name, precision,
                   hands_out=return_gathered or keep_gathered_input, plan=plan)
  if keep_gathered_input and config.reuse_gathered is not False and not (
      route.gathered_forward.reuse):
    warnings.warn("keep_gathered_input=True: the fused op cannot hand out its gathered "
                  f"input ({route.gathered_forward.reason}); the forward pass all-gathers "
                  "it with lax.all_gather instead", RuntimeWarning, stacklevel=3)
  static = _Static(axis_name, transpose_w, route, return_gathered, keep_gathered_input,
                   precision, plan=plan)
  y = _all_gather_matmul_jit(*vma.varying_along(axis_name, x, w), static)
  return y if bias is None else ((y[0] + bias, y[1]) if return_gathered else y + bias)


def matmul_reduce_scatter_unchecked(x, w, axis_name, *, transpose_w, precision, config,
                                    fp8_history=None, activation=None, merge_heads=None, plan):
  """:func:`matmul_reduce_scatter` for callers that validated the arguments, of
  ``activation(x)`` where one is given (an elementwise function: the FP8 op
  applies it inside x's cast, docs/fp8.md "Fused casts"); `plan` as there."""
  precision = validation.check_op_options("matmul_reduce_scatter", config, fp8_history, precision)
  plan = given(plan, "matmul_reduce_scatter_unchecked")
  if fp8_route(config, plan).fp8:
    return fp8_matmul_reduce_scatter(
        x, w, axis_name, recipe=config.fp8, transpose_w=transpose_w,
        reuse_gathered=config.reuse_gathered is not False, history=fp8_history,
        collectives=fp8_collectives(config, RS, x, w, transpose_w, axis_name, False, plan)[0],
        activation=activation, merge_heads=merge_heads)
  if activation is not None:
    x = scoped_activation(activation, x)
  route = op_route(config, RS, x, w, transpose_w, axis_name, precision, False, plan)
  static = _Static(axis_name, transpose_w, route, precision=precision, plan=plan)
  return _matmul_reduce_scatter_jit(*vma.varying_along(axis_name, x, w), static)


def fp8_mlp_unchecked(x, w1, b1, w2, axis_name, *, activation, keep_gathered_input, precision,
                      config, fp8_histories=(None, None), prologue=None, plan):
  """``RS(activation(AG(x) @ w1 + b1) @ w2)`` under ``config.fp8``, for callers
  that validated the arguments (x ``[n/P, k]``, or `prologue`'s operands as in
  :func:`all_gather_matmul_unchecked`): the two FP8 ops in one custom_vjp
  (:func:`jax_comm_gemm.fp8.fp8_mlp`), so that the gradients through the
  activation and of b1 come from fc1's gradient cast."""
  for history in fp8_histories:
    precision = validation.check_op_options("mlp", config, history, precision)
  first = x[0] if prologue is not None else x
  hidden = jax.ShapeDtypeStruct((first.shape[0] * lax.axis_size(axis_name), w2.shape[0]),
                                first.dtype)  # fc2's input (half of w1's width if gated)
  plan = given(plan, "fp8_mlp_unchecked")
  fp8_route(config, plan)  # a JAX_COMM_GEMM_BACKEND that FP8 cannot run on raises
  collectives = (
      fp8_collectives(config, AG, first, w1, False, axis_name, keep_gathered_input, plan)[0],
      fp8_collectives(config, RS, hidden, w2, False, axis_name, False, plan)[0])
  return fp8_mlp(x, w1, b1, w2, axis_name, activation=activation, recipe=config.fp8,
                 keep_gathered_input=keep_gathered_input,
                 reuse_gathered=config.reuse_gathered is not False, collectives=collectives,
                 histories=tuple(fp8_histories), prologue=prologue)


def scoped_activation(activation, x):
  """``activation(x)`` under the name scope "activation": profiles
  (benchmarks/producers.py) tell its passes by it, since jax keeps its own
  frames out of the HLO."""
  with jax.named_scope("activation"):
    return activation(x)


def _gathering_matmul(s: _Static, backend: Backend, route, x, w, transpose_w):
  """``(AG(x) @ w, AG(x))``, AG(x) from the op where `route` says so, else lax.all_gather."""
  if route.reuse:
    return backend.all_gather_matmul(x, w, s.axis_name, transpose_w=transpose_w,
                                     return_gathered=True, precision=s.precision)
  y = backend.all_gather_matmul(x, w, s.axis_name, transpose_w=transpose_w,
                                return_gathered=False, precision=s.precision)
  with jax.named_scope("jax_comm_gemm.all_gather"):
    return y, all_gather_tokens(x, s.axis_name)


# --- all_gather_matmul -------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, s: _Static):
  if s.return_gathered:
    return _gathering_matmul(s, s.route.forward, s.route.gathered_forward, x, w, s.transpose_w)
  return s.route.forward.all_gather_matmul(x, w, s.axis_name, transpose_w=s.transpose_w,
                                           return_gathered=False, precision=s.precision)


def _all_gather_matmul_fwd(x, w, s: _Static):
  x, w = x.value, w.value
  if s.return_gathered or s.keep_gathered_input:
    y, g = _gathering_matmul(s, s.route.forward, s.route.gathered_forward, x, w,
                             s.transpose_w)
    return ((y, g) if s.return_gathered else y), (g, w)
  y = s.route.forward.all_gather_matmul(x, w, s.axis_name, transpose_w=s.transpose_w,
                                        return_gathered=False, precision=s.precision)
  return y, (x, w)


def _all_gather_matmul_bwd(s: _Static, res, ct):
  operand, w = res
  ct_y, ct_g = ct if s.return_gathered else (ct, None)
  dx = dw = None
  if not isinstance(ct_y, SymbolicZero):
    # dx = RS(dy @ w.T): the fused GEMM+ReduceScatter with the other transpose.
    dx = s.route.backward.matmul_reduce_scatter(ct_y, w, s.axis_name,
                                         transpose_w=not s.transpose_w,
                                         precision=s.precision)
    if s.return_gathered or s.keep_gathered_input:
      gathered = operand
    else:
      with jax.named_scope("jax_comm_gemm.all_gather"):
        gathered = all_gather_tokens(operand, s.axis_name)
    dw = weight_gradient(gathered, ct_y, s.transpose_w, s.precision)
  if ct_g is not None and not isinstance(ct_g, SymbolicZero):
    # all_gather's transpose is psum_scatter.
    dg = lax.psum_scatter(ct_g, s.axis_name, scatter_dimension=0, tiled=True)
    dx = dg if dx is None else dx + dg
  return (_or_zeros(dx, _local_input_shape(operand, s), w.dtype, operand),
          _or_zeros(dw, w.shape, w.dtype, w))


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd, symbolic_zeros=True)


def _local_input_shape(operand, s: _Static):
  if not (s.return_gathered or s.keep_gathered_input):
    return operand.shape
  return (operand.shape[0] // lax.axis_size(s.axis_name), operand.shape[1])


def _or_zeros(value, shape, dtype, like):
  """`value`, or zeros that vary along the same mesh axes as `like` (a
  cotangent must have its primal's type, varying axes included)."""
  if value is not None:
    return value
  return vma.pvary(jnp.zeros(shape, dtype), vma.varying_axes(like))


# --- matmul_reduce_scatter ---------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, s: _Static):
  return s.route.forward.matmul_reduce_scatter(x, w, s.axis_name, transpose_w=s.transpose_w,
                                               precision=s.precision)


def _matmul_reduce_scatter_fwd(x, w, s: _Static):
  x, w = x.value, w.value
  y = s.route.forward.matmul_reduce_scatter(x, w, s.axis_name, transpose_w=s.transpose_w,
                                            precision=s.precision)
  return y, (x, w)


def _matmul_reduce_scatter_bwd(s: _Static, res, ct_y):
  x, w = res
  if isinstance(ct_y, SymbolicZero):
    return (_or_zeros(None, x.shape, x.dtype, x), _or_zeros(None, w.shape, w.dtype, w))
  # dx = AG(dy) @ w.T: the fused AllGather+GEMM, which also gathers dy for dw.
  dx, gathered_dy = _gathering_matmul(s, s.route.backward, s.route.gathered_backward, ct_y, w,
                                      not s.transpose_w)
  return dx, weight_gradient(x, gathered_dy, s.transpose_w, s.precision)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd,
                              symbolic_zeros=True)

# The custom_vjps run inside a jit of their own: under the caller's jit it is
# inlined, and in an eager (not jitted) shard_map it is what makes them run at
# all (eager shard_map does not take custom_vjp's symbolic zeros).
_all_gather_matmul_jit = jax.jit(_all_gather_matmul, static_argnums=(2,))
_matmul_reduce_scatter_jit = jax.jit(_matmul_reduce_scatter, static_argnums=(2,))
