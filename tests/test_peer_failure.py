"""A rank that fails tells its peers (jax_comm_gemm/runtime/peers.py): its own
failure goes to the key-value store under its group, and every healthy context
of the group, in any process, is aborted with "rank R failed: <reason>" within
a poll, instead of waiting out JAX_COMM_GEMM_TIMEOUT. Here with stand-in
contexts: in one process through a store in memory, and in two processes
joined by jax.distributed through the real store."""

import json

import pytest

from jax_comm_gemm.runtime.peers import Herald
from test_multiprocess import TIMEOUT_S, _free_port, _launch, _run_both

GROUP, OTHER = 0x1234, 0x5678
OOM = "ncclMemAlloc failed: out of memory"


class Process:
  """One process's contexts ((group, device, rank) -> error) and its herald,
  on a store shared with the other Processes of a test."""

  def __init__(self, store: dict, members, clock=lambda: 100.0):
    self.errors = {m: "" for m in members}
    self.aborts = []
    self.herald = Herald(self.contexts, self.abort, publish=store.__setitem__,
                         listing=lambda prefix: [(k, v) for k, v in store.items()
                                                 if k.startswith(prefix)], clock=clock)

  def contexts(self):
    return [{"group": g, "device": d, "rank": r, "error": e}
            for (g, d, r), e in self.errors.items()]

  def abort(self, group, device, reason):
    for (g, d, r) in self.errors:
      if (g, d) == (group, device) and not self.errors[(g, d, r)]:
        self.errors[(g, d, r)] = reason
    self.aborts.append((group, device, reason))


def test_a_failed_rank_ends_its_peers_with_its_reason():
  store = {}
  failed, peer = Process(store, [(GROUP, 0, 0)]), Process(store, [(GROUP, 0, 1)])
  for p in (failed, peer):
    p.herald.watch(GROUP, comm_id=7, attempt=1, multi_process=True)
  assert failed.herald.check() == [] and peer.herald.check() == []  # all healthy
  failed.errors[(GROUP, 0, 0)] = OOM
  failed.herald.check()
  assert [json.loads(v)["reason"] for v in store.values()] == [OOM]
  assert peer.herald.check() == [(GROUP, 0, f"rank 0 failed: {OOM}")]
  # Told, the peer publishes nothing of its own, and is not told twice.
  peer.herald.check()
  assert len(store) == 1 and len(peer.aborts) == 1
  assert failed.aborts == []  # a rank is not told of its own failure


def test_the_first_failure_is_the_reason_given():
  store = {}
  clock = iter([3.0, 4.0, 5.0])
  first = Process(store, [(GROUP, 0, 0)], clock=lambda: 1.0)
  later = Process(store, [(GROUP, 0, 1)], clock=lambda: 2.0)
  peer = Process(store, [(GROUP, 0, 2)], clock=lambda: next(clock))
  for p in (first, later, peer):
    p.herald.watch(GROUP, 7, 1, True)
  later.errors[(GROUP, 0, 1)] = "NCCL reported an asynchronous error: remote process exited"
  first.errors[(GROUP, 0, 0)] = OOM
  later.herald.check()
  first.herald.check()
  assert peer.herald.check() == [(GROUP, 0, f"rank 0 failed: {OOM}")]


def test_other_groups_and_groups_made_again_are_not_told():
  store = {}
  failed = Process(store, [(GROUP, 0, 0), (OTHER, 1, 0)])
  peer = Process(store, [(GROUP, 0, 1), (OTHER, 1, 1)])
  for p in (failed, peer):
    p.herald.watch(GROUP, 7, 1, True)
    p.herald.watch(OTHER, 8, 1, True)
  failed.errors[(GROUP, 0, 0)] = OOM
  failed.herald.check()
  assert peer.herald.check() == [(GROUP, 0, f"rank 0 failed: {OOM}")]
  assert peer.errors[(OTHER, 1, 1)] == ""
  again = Process(store, [(GROUP, 0, 1)])  # the group made again by a later connect
  again.herald.watch(GROUP, 9, 1, True)
  assert again.herald.check() == []


def test_contexts_of_one_process_tell_each_other_without_the_store():
  store = {}
  both = Process(store, [(GROUP, 0, 0), (GROUP, 1, 1)])
  both.herald.watch(GROUP, 7, 1, multi_process=False)
  both.errors[(GROUP, 1, 1)] = OOM
  assert both.herald.check() == [(GROUP, 0, f"rank 1 failed: {OOM}")]
  assert store == {}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_processes_a_failure_in_one_ends_the_others_wait_within_seconds():
  port = _free_port()
  procs = [_launch(i, port, worker="mp_peer_failure_worker.py") for i in range(2)]
  _, peer = _run_both(procs, TIMEOUT_S)
  assert peer["waited_s"] < 5, peer
  # Process 0 holds ranks 0 and 1, both failed at once: the first rank is named.
  assert peer["reason"] == ["rank 0 failed: ncclMemAlloc failed: out of memory (planted)"], peer
