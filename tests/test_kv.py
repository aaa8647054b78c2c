"""runtime/kv.py's exchanges between processes (gather, all_gather,
broadcast), and connect's and autotune_step's agreements built on them, with
several processes simulated by threads over one key-value store."""

import math
import threading

import jax
import pytest

from conftest import stand_in_plan

import jax_comm_gemm.runtime.kv as kv
from jax_comm_gemm.runtime import agreement
from jax_comm_gemm.backends import tuning


class FakeJob:
  """A key-value store that, like jax.distributed's, takes each key once and
  makes a reader wait for it; and a thread per process."""

  def __init__(self, processes: int):
    self.processes = processes
    self.store: dict[str, str] = {}
    self.ready = threading.Condition()
    self.me = threading.local()

  def publish(self, name, value):
    with self.ready:
      assert name not in self.store, f"{name} written twice"
      self.store[name] = value
      self.ready.notify_all()

  def fetch(self, name, timeout_s):
    with self.ready:
      if not self.ready.wait_for(lambda: name in self.store, timeout=timeout_s):
        raise TimeoutError(name)
      return self.store[name]

  def run(self, body):
    """body(process) in every process at once; their results in process order."""
    results, errors = [None] * self.processes, []

    def main(process):
      self.me.index = process
      try:
        results[process] = body(process)
      except Exception as e:  # noqa: BLE001  (reported below)
        errors.append(e)

    threads = [threading.Thread(target=main, args=(p,)) for p in range(self.processes)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(10)
    assert not errors, errors
    return results


@pytest.fixture
def job(monkeypatch):
  job = FakeJob(3)
  monkeypatch.setattr(kv, "publish", job.publish)
  monkeypatch.setattr(kv, "fetch", job.fetch)
  monkeypatch.setattr(kv, "multi_process", lambda: True)
  monkeypatch.setattr(jax, "process_index", lambda: job.me.index)
  monkeypatch.setattr(jax, "process_count", lambda: job.processes)
  return job


def test_gather_gives_process_0_every_value_in_order(job):
  got = job.run(lambda p: kv.gather(5, 1, "times", value={"p": p}, timeout_s=5))
  assert got == [[{"p": 0}, {"p": 1}, {"p": 2}], None, None]


def test_all_gather_gives_every_process_every_value(job):
  got = job.run(lambda p: kv.all_gather(5, 1, "failed", value=[f"c{p}"], timeout_s=5))
  assert got == [[["c0"], ["c1"], ["c2"]]] * 3


def test_all_gather_among_some_processes_leaves_the_others_out(job):
  """A tensor-parallel group's processes exchange among themselves, in the
  order given; a process outside the group takes no part (connect's
  agreement runs per group)."""
  group = [2, 0]
  got = job.run(lambda p: kv.all_gather(5, 1, "fp", value=p, timeout_s=5, processes=group)
                if p in group else None)
  assert got == [[2, 0], None, [2, 0]]
  assert not any(name.endswith("/1") for name in job.store)


def test_the_agreement_check_raises_in_every_member_of_the_group(job):
  fingerprints = {0: {"fence": "isolated"}, 1: {"fence": "none"}, 2: {"fence": "host"}}

  def body(p):
    if p == 1:
      return None
    try:
      agreement.check(fingerprints[p], comm_id=5, attempt=1, processes=[0, 2], timeout_s=5)
    except agreement.DisagreementError as e:
      return str(e)
    return "agreed"

  got = job.run(body)
  assert got[0] == got[2] and got[1] is None
  assert "fence differs (process 0: 'isolated'; process 2: 'host')" in got[0]


def test_broadcast_gives_every_process_process_0s_value(job):
  # The others' values are not read; every process gets the same JSON types.
  got = job.run(lambda p: kv.broadcast(5, 1, "plan", value=("xla", p) if p == 0 else "?",
                                       timeout_s=5))
  assert got == [["xla", 0]] * 3


def test_one_process_passes_values_through_json(monkeypatch):
  monkeypatch.setattr(kv, "multi_process", lambda: False)
  assert kv.gather(5, 1, "t", value=("a", math.inf), timeout_s=1) == [["a", math.inf]]
  assert kv.all_gather(5, 1, "t", value={"x": 1}, timeout_s=1) == [{"x": 1}]
  assert kv.broadcast(5, 1, "t", value=("a", "b"), timeout_s=1) == ["a", "b"]


def test_a_missing_peer_is_a_timeout_not_a_hang(job):
  job.processes = 2  # process 1 never publishes
  job.me.index = 0
  with pytest.raises(TimeoutError):
    kv.gather(5, 1, "lonely", value=1, timeout_s=0.2)


def test_autotune_step_takes_process_0s_decision_from_the_slowest_times(job):
  """Each process timed the plans; the slowest process's time counts, process 0
  decides, and every process returns the same plan and reason."""
  times = [{"xla": 1.00, "pipelined_ce": 0.90}, {"xla": 1.10, "pipelined_ce": 0.95},
           {"xla": 1.00, "pipelined_ce": 0.99}]
  got = job.run(lambda p: tuning.agreed_choice(9, 1, ("step",), times[p], 5, {},
                                                       tuning.decide_step))
  assert got[0] == got[1] == got[2]
  plan, why = got[0]
  assert plan == "pipelined_ce" and "all pipelined_ce 990.000 ms" in why


def test_autotune_measures_in_every_process_and_all_take_process_0s_choices(
    job, monkeypatch, tmp_path):
  """The whole protocol of autotune with stand-ins for the GPU parts: process 0
  says which problems to measure (one is in its disk cache), every process
  times each, process 0 decides from the slowest and saves the cache, and every
  process records the same choices."""
  from jax_comm_gemm.backends import tuning  # noqa: PLC0415
  from jax_comm_gemm.backends.routes import AG, RS, Problem  # noqa: PLC0415
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  from jax_comm_gemm.runtime.capability import Capability  # noqa: PLC0415

  cached = Problem(AG, 1024, 512, 256, "bfloat16", False, 2)
  slow_fused = Problem(AG, 4096, 512, 256, "bfloat16", False, 2)
  fused_wins = Problem(RS, 4096, 256, 512, "bfloat16", False, 2)
  cache_file = tmp_path / "autotune.json"
  tuning.save_cache(str(cache_file), {"sig": {cached.text(): ["ring", "measured: before"]}})
  REGISTRY.publish(stand_in_plan(autotune_cache=str(cache_file)))
  monkeypatch.setattr(tuning, "tunable", lambda mesh, axis, plan: None)
  monkeypatch.setattr(REGISTRY, "next_attempt", lambda key: 1)
  monkeypatch.setattr(tuning, "comm_id", lambda mesh, axis: 7)
  monkeypatch.setattr(tuning, "signature", lambda: "sig")
  monkeypatch.setattr(tuning, "_runnables", lambda mesh, axis, p, seconds, plan: p)
  # Process 2 is the slow one for the fused candidate of the first problem.
  times = {slow_fused: [{"xla": 1.0, "pipelined_ce": 0.8}, {"xla": 1.0, "pipelined_ce": 0.8},
                        {"xla": 1.0, "pipelined_ce": 1.3}],
           fused_wins: [{"xla": 1.0, "pipelined_ce": 0.7}] * 3}

  def fake_time(p, *, rounds, warmup_rounds, agree, verify, reference, about):
    assert agree({}) == {}  # the failures are agreed on too
    assert reference == "xla" and about == p.text()  # the error would name the problem
    # Each problem's candidates are checked against XLA's result.
    y = jax.numpy.ones((4, 4))
    assert verify("xla", y) is None and verify("ring", y) is None
    assert "differs from XLA's" in verify("pipelined_ce", 2 * y)
    return times[p][jax.process_index()]

  monkeypatch.setattr(tuning, "time_candidates", fake_time)
  mesh = type("Mesh", (), {"shape": {"tp": 2}})()
  got = job.run(lambda p: tuning.autotune(mesh, "tp", [cached, slow_fused, fused_wins]))
  assert got[0] == got[1] == got[2]
  assert {p: c[0] for p, c in got[0].items()} == {
      cached: "ring", slow_fused: "xla", fused_wins: "pipelined_ce"}
  saved = tuning.load_cache(str(cache_file))["sig"]
  assert saved[slow_fused.text()][0] == "xla" and saved[cached.text()][0] == "ring"
  assert REGISTRY.plan().decision(fused_wins)[0] == "pipelined_ce"
