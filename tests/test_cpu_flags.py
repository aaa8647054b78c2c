"""The CPU test processes' XLA flags: only those the running XLA accepts."""

from tests.cpu_flags import WANTED, cpu_test_flags, xla_refusal


def test_a_flag_xla_does_not_know_is_reported_not_fatal():
  refusal = xla_refusal("--xla_no_such_flag_anywhere=1")
  assert refusal is not None and "xla_no_such_flag_anywhere" in refusal


def test_the_kept_flags_start_this_xla():
  kept = cpu_test_flags().split()
  assert set(kept) <= set(WANTED)
  assert xla_refusal(" ".join(kept)) is None
