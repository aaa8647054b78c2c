"""A CPU stand-in for the opaque cuBLASMp custom calls.

On a GPU the fused AllGather+GEMM is one custom call: XLA cannot see the
all-gather inside it, so it cannot merge it with a standalone ``lax.all_gather``
of the same value. On CPU the :class:`~jax_comm_gemm.backends.XlaBackend` ops
are plain HLO, and XLA does merge (CSE) identical all-gathers, which would hide
the routing. :class:`EmulatedFusedBackend` restores the opacity:

* each "fused op" runs under ``jax.named_scope(SCOPE)``, so its collectives can
  be told apart in the compiled HLO (``hlo.count_collectives(text, SCOPE)``);
* its inputs pass through ``lax.optimization_barrier`` first;
* its all-gather moves the operand's bits as unsigned integers of the same
  width (``bitcast_convert_type`` there and back: exact). The barrier alone is
  not enough: XLA's CPU pipeline removes optimization barriers before its last
  CSE pass, and the all-gathers merged again (seen with jax 0.10.2). An
  all-gather of a ``u16``/``u32`` value cannot merge with one of a float value.

``expose`` plays the role of the cached capability verdict: whether the fused
op may hand out the operand it gathered.

The module also holds what the numerics tests share: the routings they run
through (``ROUTINGS``), random inputs, and the float64 reference check.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_comm_gemm.backends import (Capability, XlaBackend, all_gather_tokens,
                                    local_matmul)
from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.diagnostics import hlo

SCOPE = "fused_emulation"

_BITS = {2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True)
class EmulatedFusedBackend(XlaBackend):
  """XlaBackend's numbers from ops that XLA cannot merge with its own, tagged
  with the SCOPE name."""

  expose: bool = True

  name = "fused_emulation"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    with jax.named_scope(SCOPE):
      x, w = lax.optimization_barrier((x, w))
      bits = lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])
      gathered = lax.bitcast_convert_type(all_gather_tokens(bits, axis_name), x.dtype)
      y = local_matmul(gathered, w, transpose_w, precision)
      return (y, gathered) if return_gathered else y

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    with jax.named_scope(SCOPE):
      x, w = lax.optimization_barrier((x, w))
      return super().matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w,
                                           precision=precision)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    if self.expose:
      return Capability(True, "the emulated fused op hands out its gathered operand")
    return Capability(False, "the emulated fused op keeps its gathered operand to itself")


# The routings that the numerics tests run through: XLA, reusing the gathered
# operand or gathering again, and the emulated fused op, exposing it or not.
ROUTINGS = {
    "xla": CommGemmConfig(),
    "xla_no_reuse": CommGemmConfig(reuse_gathered=False),
    "fused_expose": CommGemmConfig(backend=EmulatedFusedBackend(expose=True)),
    "fused_hidden": CommGemmConfig(backend=EmulatedFusedBackend(expose=False)),
}


# --- Numerics helpers shared by the test modules -------------------------------

# Relative-norm error bounds against a float64 reference.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def random_inputs(seed: int, shapes, dtype):
  """Normal random arrays of `shapes`, each from its own key, in `dtype`."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(key, shape, jnp.float32).astype(dtype)
          for key, shape in zip(keys, shapes)]


def relative_error(actual, expected) -> float:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_close(what: str, actual, expected, dtype) -> None:
  """`actual` has `dtype`, the shape of `expected` and is within TOLERANCE of it."""
  dtype = jnp.dtype(dtype)
  assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
  assert actual.shape == np.shape(expected), (
      f"{what}: shape {actual.shape}, expected {np.shape(expected)}")
  if not np.any(expected):
    assert not np.any(np.asarray(actual)), f"{what}: expected exact zeros"
    return
  err = relative_error(actual, expected)
  assert err <= TOLERANCE[dtype], (
      f"{what}: relative error {err:.3g} exceeds {TOLERANCE[dtype]:g} ({dtype})")


def reference_value_and_grad(fn, args, cotangents):
  """The plain, unsharded computation in float64 on one device.

  `fn(*args)` returns a tuple of outputs; the loss is the sum of each output
  times its cotangent. Returns (outputs, gradients w.r.t. every arg), numpy.
  """
  with jax.enable_x64(True):
    args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
    cts64 = [jnp.asarray(np.asarray(c, np.float64)) for c in cotangents]

    def loss(*a):
      return sum(jnp.sum(o * c) for o, c in zip(fn(*a), cts64))

    outs = fn(*args64)
    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args64)
    return [np.asarray(o) for o in outs], [np.asarray(g) for g in grads]


def loss_with_outputs(fn, nargs: int):
  """``value_and_grad`` of sum(output * cotangent) (in float32) w.r.t. the first
  `nargs` arguments of ``fn(*args, cotangents)``; the outputs come as aux."""

  def loss(*args):
    *args, cotangents = args
    outs = fn(*args)
    total = sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cotangents))
    return total, outs

  return jax.value_and_grad(loss, argnums=tuple(range(nargs)), has_aux=True)


def check_against_reference(fn, reference, args, out_shapes, dtype, seed: int,
                            arg_names=None):
  """Runs ``fn(*args)`` (a tuple of outputs) under ``jax.jit``, plainly and
  under ``jax.value_and_grad`` of a random linear loss, and checks outputs and
  gradients against ``reference`` in float64. Returns (outputs, gradients)."""
  cotangents = random_inputs(seed + 1, out_shapes, jnp.float32)
  grad_fn = loss_with_outputs(fn, len(args))

  @jax.jit
  def run(args, cotangents):
    (_, outs), grads = grad_fn(*args, cotangents)
    return fn(*args), outs, grads

  plain, outs, grads = run(tuple(args), cotangents)
  ref_outs, ref_grads = reference_value_and_grad(reference, args, cotangents)
  for i, ref in enumerate(ref_outs):
    assert_close(f"output {i}", plain[i], ref, dtype)
    assert_close(f"output {i} (under grad)", outs[i], ref, dtype)
  names = arg_names or [f"arg {i}" for i in range(len(args))]
  for name, grad, ref in zip(names, grads, ref_grads):
    assert_close(f"gradient w.r.t. {name}", grad, ref, dtype)
  return plain, grads


def standalone_all_gathers(step, args) -> int:
  """All-gathers in the compiled `step` (jitted, on `args`) outside the
  emulated fused ops: those the routing emitted."""
  text = step.lower(*args).compile().as_text()
  return hlo.count_collectives(text).all_gather - hlo.count_collectives(text, SCOPE).all_gather
