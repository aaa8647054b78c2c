"""How close two differently compiled programs must agree.

Two programs that compute the same float expression need not round alike: XLA
may sum a reduction in another order (its blocking, threads, vector width) or
contract a multiply and an add into one FMA, and it compiles each program on
its own. A comparison between two such programs is bit for bit only where the
result is exact by construction (integers, copies and gathers of the same
bytes, bit patterns, maxima, scaling by a power of two, the same compiled
program run twice); the tests say so beside each such comparison. Everywhere
else they use the bound below.

Summing k terms in a float type of machine epsilon eps (unit roundoff eps/2),
every partial sum at most `scale` in magnitude, is off by at most
(k - 1) * eps/2 * scale in the worst case and by about sqrt(k) * eps/2 * scale
for rounding errors of random sign (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., section 3.1; Higham and Mary, SIAM J. Sci.
Comput. 41(5), 2019). Two programs' results differ by up to twice one's error,
sqrt(k) * eps * scale. The tolerance allows ``ULPS * eps * sqrt(k) * scale``
(ULPS = 4): that, with room for the scaling multiplies around the reduction
and the ulps carried in from upstream reductions. `scale` defaults to the
largest magnitude of the expected result (a GEMM's partial sums are of the
size of its outputs); for a chain of reductions `k` is the sum of their
lengths.

Breakages this is meant to catch stay far outside it: a scale off by a factor,
a dropped or doubled term, the wrong operand or shard are off by a sizeable
fraction of `scale`, while in float32 the bound is below 1e-4 of it for every
k up to 10,000 (3.3e-6 for a GEMM over 48 features).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ULPS = 4


def eps(dtype) -> float:
  """Machine epsilon of a float dtype (bfloat16 and the FP8 types included)."""
  return float(jnp.finfo(dtype).eps)


def reduction_atol(dtype, k: int, scale: float, ulps: float = ULPS) -> float:
  """The absolute tolerance between two programs that sum `k` terms in
  `dtype`, their partial sums up to `scale`: ``ulps * eps * sqrt(k) * scale``."""
  return ulps * eps(dtype) * np.sqrt(k) * float(scale)


def assert_reduction_close(got, want, *, k: int, dtype=np.float32, scale=None,
                           ulps: float = ULPS, what: str = "") -> None:
  """`got` equals `want` up to :func:`reduction_atol` everywhere (shape and
  NaNs included); `scale` defaults to ``max |want|``."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
  if scale is None:
    finite = want[np.isfinite(want)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
  atol = reduction_atol(dtype, k, scale, ulps)
  np.testing.assert_allclose(
      got, want, rtol=0, atol=atol, equal_nan=True,
      err_msg=(f"{what}: beyond {ulps} * eps({np.dtype(dtype).name}) * sqrt({k}) * "
               f"{scale:.4g} = {atol:.3g}"))


def assert_differs(got, want, *, k: int, dtype=np.float32, scale=None,
                   ulps: float = ULPS, what: str = "") -> None:
  """Somewhere `got` is farther from `want` than :func:`reduction_atol`: a
  difference that rounding cannot explain."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if scale is None:
    scale = float(np.max(np.abs(want)))
  atol = reduction_atol(dtype, k, scale, ulps)
  assert np.max(np.abs(got - want)) > atol, (
      f"{what}: within {atol:.3g} of each other; expected a real difference")
