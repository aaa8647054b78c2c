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

FP8. Two programs that run the same FP8 arithmetic (the same scales, the same
casts) still compute the float values they cast in their own orders. Where such
a value lies within that rounding of the midpoint between two FP8 codes, the
programs' casts pick neighbouring codes: the operand differs by one step of the
format at that value, ``2**-m * |v|`` at most (m mantissa bits: E4M3 3, E5M2 2),
and every output that sums it moves by that step times the other operand. Such
a flip is far beyond float32's rounding, so :func:`assert_reduction_close`
fails on it (and did, on a machine that rounded the other way). The bound
between two FP8 programs is ``flips * 2**-m * scale`` on top of the float32
bound (:func:`fp8_flip_atol`): `m` of the format the flip happens in (E5M2 for
what a gradient reaches, E4M3 for forward values alone), `scale` the largest
magnitude of the expected result (the tests' random operands sum 64 or more
terms, so no single term exceeds it), `flips` how many flipped codes may land
in one output (1 unless the test says why). A layout error (a swapped head or
part) or a scale off by 25% or more stays outside it: both move the largest
outputs by a quarter of their size or more. Smaller scale errors are the
float64 tests' to catch (tests/test_fp8.py checks every scale exactly). The
FP8 codes themselves, from two programs: :func:`assert_fp8_codes_close`.
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


def _operands(got, want, scale, what: str):
  """`got` and `want` in float64, of one shape, and `scale` (default: the
  largest finite magnitude of `want`)."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
  if scale is None:
    finite = want[np.isfinite(want)]
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
  return got, want, float(scale)


def assert_reduction_close(got, want, *, k: int, dtype=np.float32, scale=None,
                           ulps: float = ULPS, out_dtype=None, what: str = "") -> None:
  """`got` equals `want` up to :func:`reduction_atol` everywhere (shape and
  NaNs included); `scale` defaults to ``max |want|``. `out_dtype`: the sums
  were written in that narrower type, one rounding each: one of its steps
  (``eps * |want|``) more."""
  got, want, scale = _operands(got, want, scale, what)
  atol = reduction_atol(dtype, k, scale, ulps)
  np.testing.assert_allclose(
      got, want, rtol=0 if out_dtype is None else eps(out_dtype), atol=atol, equal_nan=True,
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


def fp8_step(fmt) -> float:
  """One step of an FP8 format relative to the value it is at: ``2**-m``
  (E4M3 1/8, E5M2 1/4)."""
  return 2.0 ** -int(jnp.finfo(fmt).nmant)


def fp8_flip_atol(fmt, scale: float, flips: int = 1) -> float:
  """How far `flips` flipped FP8 codes of format `fmt` can move an output of
  magnitude up to `scale`: ``flips * 2**-m * scale``."""
  return flips * fp8_step(fmt) * float(scale)


def assert_fp8_programs_close(got, want, *, fmt, k: int, flips: int = 1, scale=None,
                              what: str = "") -> None:
  """Two programs of the same FP8 arithmetic agree within `flips` flipped
  codes of `fmt` (:func:`fp8_flip_atol`) plus float32's reduction bound over
  `k` terms (:func:`reduction_atol`), everywhere (shape and NaNs included)."""
  got, want, scale = _operands(got, want, scale, what)
  atol = fp8_flip_atol(fmt, scale, flips) + reduction_atol(np.float32, k, scale)
  np.testing.assert_allclose(
      got, want, rtol=0, atol=atol, equal_nan=True,
      err_msg=(f"{what}: beyond {flips} flipped {np.dtype(fmt).name} code(s) "
               f"({flips} * 2**-{jnp.finfo(fmt).nmant} * {scale:.4g}) + float32's "
               f"rounding over {k} terms = {atol:.3g}"))


def fp8_codes(a) -> np.ndarray:
  """An FP8 array's codes in value order: sign-magnitude bytes as signed
  integers, so neighbouring values are neighbouring integers."""
  b = np.asarray(a).view(np.uint8).astype(np.int16)
  return np.where(b & 0x80, -(b & 0x7F), b)


def assert_fp8_codes_close(got, want, *, what: str = "") -> None:
  """Two programs' FP8 casts of values each computed in its own order: every
  code equal to `want`'s or one step from it in value order (a value at a
  rounding midpoint), NaNs where `want` has them. A layout or scale error
  moves codes by many steps."""
  g, w = np.asarray(got), np.asarray(want)
  assert g.shape == w.shape and g.dtype == w.dtype, (
      f"{what}: {g.dtype}{g.shape}, expected {w.dtype}{w.shape}")
  gf, wf = g.astype(np.float32), w.astype(np.float32)
  nan = np.isnan(wf)
  np.testing.assert_array_equal(np.isnan(gf), nan, err_msg=f"{what}: NaNs differ")
  apart = np.abs(fp8_codes(g) - fp8_codes(w))
  bad = (apart > 1) & ~nan  # -0 and +0 are both code 0
  assert not bad.any(), (f"{what}: {int(bad.sum())} codes more than one step apart, e.g. "
                         f"{gf[bad][:3]} against {wf[bad][:3]}")
