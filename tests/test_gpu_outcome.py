"""The GPU suite's verdict on one check over its ranks (tests/gpu/outcome.py):
any rank's failure fails it, and a skip counts only where every rank skipped
for the same reason."""

from tests.gpu.outcome import FAILED, PASSED, SKIPPED, outcome

OK = {"ok": True}
FAIL = {"ok": False, "error": "AssertionError: dx off", "traceback": "tb"}


def skip(reason="needs distinct GPUs"):
  return {"ok": True, "skipped": reason}


def test_every_rank_passed():
  assert outcome([OK, OK, OK]) == (PASSED, "")


def test_one_rank_failing_fails_the_check_whatever_the_others_did():
  for others in ([OK, OK], [skip(), skip()], [OK, skip()]):
    status, why = outcome([*others, FAIL])
    assert status == FAILED and "process 2: AssertionError: dx off" in why


def test_a_skip_on_one_rank_does_not_hide_another_ranks_run():
  status, why = outcome([skip(), OK])
  assert status == FAILED and "disagree" in why and "process 1 passed" in why


def test_skipped_only_where_every_rank_skipped_for_the_same_reason():
  assert outcome([skip("a"), skip("a")]) == (SKIPPED, "a")
  status, why = outcome([skip("a"), skip("b")])
  assert status == FAILED and "skipped (a)" in why and "skipped (b)" in why


def test_no_process_reported_is_a_failure():
  assert outcome([])[0] == FAILED
