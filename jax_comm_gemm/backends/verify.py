"""Whether a candidate computed the right thing: its result against XLA's on
the same inputs, at tuning time (autotune and autotune_step time only the
candidates that agree). A fast wrong implementation must never be chosen."""

from __future__ import annotations

import jax


# How far a candidate's result may be from XLA's, over the largest value of
# XLA's (per shard): rounding to bf16 and another order of summation stay
# within about 1% at the problems measured, a wrong or stale block is off by
# the order of the values themselves.
AGREEMENT = 0.05


def mismatch(out, reference, tolerance: float = AGREEMENT) -> str | None:
  """What is wrong with `out` against `reference` (pytrees of global arrays
  with the same shardings), or None: each addressable shard compared on its
  own device, so no process waits for another (a candidate that failed in
  one process must not leave its peers in a collective)."""
  for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
    if got.shape != expected.shape:
      return f"shape {got.shape}, XLA's {expected.shape}"
    for mine, theirs in zip(got.addressable_shards, expected.addressable_shards):
      a, b = mine.data.astype("float32"), theirs.data.astype("float32")
      error, scale = float(abs(a - b).max()), float(abs(b).max())
      if not error <= tolerance * scale:  # NaN too
        return (f"differs from XLA's by {error:.3g} on device {mine.device.id} "
                f"(XLA's largest value {scale:.3g})")
  return None


def against_xla():
  """time_candidates' `verify` for one problem: XLA's warm-up result, the
  first candidate's, is the reference for the others' (mismatch)."""
  reference = {}

  def verify(name, out):
    if name == "xla":
      reference["xla"] = out
      return None
    return mismatch(out, reference["xla"]) if "xla" in reference else None
  return verify
