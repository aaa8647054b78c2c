"""The fused AllGather+GEMM and GEMM+ReduceScatter of the project's extension,
via XLA FFI: cuBLASMp's algorithms, and the project's own pipelined_ce."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

import jax_comm_gemm.backends.primitives as primitives
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.xla import XlaBackend, ring_matmul_reduce_scatter
from jax_comm_gemm.runtime.capability import VerdictKey
from jax_comm_gemm.runtime.constants import ALGORITHMS
from jax_comm_gemm.runtime.registry import current_plan


@dataclasses.dataclass(frozen=True)
class CublasMpBackend(Backend):
  """The fused ops on the communicators that ``connect`` set up.

  Its fields are the fused ops' options, and their defaults are the
  project's: ``CommGemmConfig`` takes its own defaults from here
  (config.py), so each is written once.

  Attributes:
    all_gather_algorithm: algorithm of the AllGather+GEMM (config.py).
    reduce_scatter: ``"xla"``, ``"ring"``, or an algorithm (config.py).

  >>> CublasMpBackend().all_gather_algorithm
  'split_p2p'
  """

  all_gather_algorithm: str = "split_p2p"
  reduce_scatter: str = "xla"

  name = "cublasmp"
  fp8_fused_ops = True

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    # cuBLASMp computes in float32 (CUBLAS_COMPUTE_32F): `precision` is moot.
    if lax.axis_size(axis_name) == 1:  # nothing to communicate
      return XlaBackend().all_gather_matmul(x, w, axis_name, transpose_w=transpose_w,
                                            return_gathered=return_gathered,
                                            precision=precision)
    if return_gathered:
      verdict = self.gathered_reuse(lax.axis_size(axis_name), x.dtype, transpose_w)
      if not verdict.ok:  # a caller that skipped routes.gathered_route
        raise RuntimeError(f"the gathered operand was asked for without a passing "
                           f"verdict: {verdict.reason}")
    outs = primitives.all_gather_matmul(
        x, w, axis_name, transpose_w=transpose_w, return_gathered=return_gathered,
        algorithm=ALGORITHMS[self.all_gather_algorithm], layout=_layout())
    return tuple(outs) if return_gathered else outs[0]

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    if self.reduce_scatter == "xla" or lax.axis_size(axis_name) == 1:
      return XlaBackend().matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w,
                                                precision=precision)
    if self.reduce_scatter == "ring":
      return ring_matmul_reduce_scatter(x, w, axis_name, transpose_w, precision)
    return primitives.matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w,
                                            algorithm=ALGORITHMS[self.reduce_scatter])

  # --- FP8 (jax_comm_gemm/fp8/steps.py calls these for `collectives=self`) ----
  # One scale per tensor; w in the TN form [features, k]; the scales are the
  # inverse (dequantizing) ones, f32 scalars (xla_ffi/plan.h).

  def fp8_all_gather_matmul(self, x8, w8, x_inv, w_inv, axis_name, *, out_dtype,
                            fast_accum, return_gathered):
    """``(y, g8)``: y = ``AG(x8) . w8^T`` scaled, and the gathered x8 where
    `return_gathered` asks for it and the self-test's verdict lets the op hand
    it out (else None: the caller gathers again)."""
    reuse = return_gathered and self.gathered_reuse(lax.axis_size(axis_name), x8.dtype,
                                                    True).ok
    outs = primitives.fp8_all_gather_matmul(
        x8, w8, x_inv, w_inv, axis_name, out_dtype=out_dtype, return_gathered=reuse,
        algorithm=ALGORITHMS[self.all_gather_algorithm], layout=_layout(),
        fast_accum=fast_accum)
    return outs[0], (outs[1] if reuse else None)

  def fp8_matmul_reduce_scatter(self, x8, w8, x_inv, w_inv, axis_name, *, out_dtype,
                                fast_accum):
    """``RS(x8 . w8^T)`` scaled, on the algorithm `reduce_scatter` names (the
    caller runs "xla" and "ring" itself, in FP8)."""
    return primitives.fp8_matmul_reduce_scatter(
        x8, w8, x_inv, w_inv, axis_name, out_dtype=out_dtype,
        algorithm=ALGORITHMS[self.reduce_scatter], fast_accum=fast_accum)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    plan = current_plan()
    return plan.verdict(VerdictKey(int(axis_size), self.all_gather_algorithm,
                                   jnp.dtype(dtype).name, bool(transpose_w), plan.layout))


def _layout() -> str:
  """Where the gathered operand is, in the plan in force."""
  return current_plan().layout
