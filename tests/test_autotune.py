"""backend="auto": the choice per problem, and how autotune makes it.

The selection logic runs on CPU with a fake timer and stand-in candidates; the
AutoBackend's dispatch is seen in the traced program (on CPU the cuBLASMp
primitive lowers to XLA's collectives, so the numbers are checked too).
"""

import dataclasses
import itertools
import math
import re
import threading

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh
from jax_comm_gemm import dense
import jax_comm_gemm.backends.tuning as autotune
from jax_comm_gemm.backends import routes
from jax_comm_gemm.backends.routes import AG, RS, AutoBackend, Problem, bound
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime import REGISTRY, settings
from jax_comm_gemm.runtime.capability import Capability
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.runtime.settings import Settings
from conftest import stand_in_plan
from test_kv import FakeJob
from jax_comm_gemm.runtime.capability import Capability
from jax_comm_gemm.runtime.constants import TARGETS


def test_decide_takes_the_fastest_by_its_slowest_process():
  choice, why = autotune.decide({"xla": [1.0e-3, 1.1e-3],
                                 "cublasmp_split_p2p": [0.8e-3, 1.2e-3],
                                 "ring": [math.inf, 0.5e-3]})
  assert choice == "xla"
  assert why == "measured: xla 1.100 ms, cublasmp_split_p2p 1.200 ms, ring failed"


def test_decide_falls_back_to_xla_when_everything_failed():
  assert autotune.decide({"ring": [math.inf], "xla": [math.inf]})[0] == "xla"


def test_time_candidates_interleaves_and_takes_medians():
  clock = itertools.count()
  order = []

  def runner(name, cost, fail=False):
    def call():
      order.append(name)
      if fail:
        raise RuntimeError("cublasMpMatmul failed: not supported")
      for _ in range(cost - 1):
        next(clock)
    return call

  timer = lambda: float(next(clock))  # noqa: E731  (each call costs its `cost` ticks)
  waits = []
  times = autotune.time_candidates(
      {"a": (runner("a", 3), 2), "b": (runner("b", 5), 1), "bad": (runner("bad", 1, True), 1)},
      rounds=3, timer=timer, wait=waits.append)
  assert times["bad"] == math.inf
  assert times["b"] > times["a"]
  # Warm-up once each, then a b, b a, a b: interleaved rounds alternating in
  # order (under the power cap a batch's clock depends on the one before), one
  # wait per batch (back-to-back calls, as in a training step), not one per call.
  assert order[3:] == ["a", "a", "b"] + ["b", "a", "a"] + ["a", "a", "b"]
  assert len(waits) == 2 + 3 * 2


def test_time_candidates_leave_the_warm_up_rounds_out():
  """The rounds before the timed ones run alike (interleaved, the same
  batches) but are not timed: the clocks before the power cap sets in are
  not the steady state (GPU run 39)."""
  clock = itertools.count()
  calls = {"a": 0, "b": 0}

  def runner(name, steady):
    def call():
      calls[name] += 1
      # Another cost while the GPU warms: the warm-up call and 3 warm-up rounds.
      for _ in range((1 if calls[name] <= 1 + 3 * 2 else steady) - 1):
        next(clock)
    return call

  waits = []
  times = autotune.time_candidates({"a": (runner("a", 5), 2), "b": (runner("b", 3), 2)},
                                   rounds=3, warmup_rounds=3,
                                   timer=lambda: float(next(clock)), wait=waits.append)
  assert calls == {"a": 1 + 6 * 2, "b": 1 + 6 * 2}
  assert len(waits) == 2 + 6 * 2
  # A batch of two calls: 2 * (cost - 1) ticks and the timer's own; a median
  # over the warm-up rounds too would fall between the two costs.
  assert times["a"] == (2 * 4 + 1) / 2 and times["b"] == (2 * 2 + 1) / 2


def test_time_candidates_takes_the_median_not_the_fastest_round():
  """One fast round (a clock swing, or a round that ran before the power cap
  bit) does not decide: the median of the rounds does."""
  clock = itertools.count()
  costs = {"a": iter([1, 9, 2, 9, 9]), "b": iter([1, 5, 5, 5, 5])}

  def runner(name):
    def call():
      for _ in range(next(costs[name]) - 1):
        next(clock)
    return call

  times = autotune.time_candidates({"a": (runner("a"), 1), "b": (runner("b"), 1)}, rounds=4,
                                   timer=lambda: float(next(clock)), wait=lambda out: None)
  # Timed rounds cost a: 9 2 9 9 and b: 5 5 5 5 ticks (plus the timer's own):
  # a's fastest round beats b's, its median does not.
  assert times["b"] < times["a"]
  assert times == {"a": 9.0, "b": 5.0}


def test_time_candidates_agree_after_every_step_and_skip_what_any_process_failed(caplog):
  """The failures are agreed after building, after each warm-up and after
  each timed batch, before the next candidate runs: a candidate that failed
  in another process (here "ring", while timed) is skipped here from then
  on, as a collective candidate that a peer skips would leave this process
  waiting. Each failure is logged with its error."""
  events = []

  def runner(name, fail=False):
    def call():
      events.append(name)
      if fail:
        raise RuntimeError("cublasMpMatmul failed: not supported")
    return call

  def agree(failed):  # a peer fails "ring" in the first timed round
    events.append(("agree", dict(failed)))
    peer = {"ring": "process 1: lost"} if events.count("ring") == 2 else {}
    return {name: f"process 0: {why}" for name, why in failed.items()} | peer

  with caplog.at_level("WARNING", logger="jax_comm_gemm.autotune"):
    times = autotune.time_candidates(
        {"xla": (runner("xla"), 1), "ring": (runner("ring"), 1),
         "bad": (runner("bad", fail=True), 1), "unbuilt": "XlaRuntimeError: no kernel"},
        rounds=2, wait=lambda out: None, agree=agree)
  assert events == [
      ("agree", {"unbuilt": "XlaRuntimeError: no kernel"}),  # built, or not, everywhere
      "xla", ("agree", {}), "ring", ("agree", {}),            # warm-ups, each agreed
      "bad", ("agree", {"bad": "cublasMpMatmul failed: not supported"}),
      "xla", ("agree", {}), "ring", ("agree", {}),            # round 1: the peer lost ring
      "xla", ("agree", {})]                                   # round 2: xla alone
  assert math.isfinite(times["xla"])
  assert times["ring"] == times["bad"] == times["unbuilt"] == math.inf
  assert "candidate bad failed: cublasMpMatmul failed: not supported" in caplog.text
  assert "candidate unbuilt failed to build: XlaRuntimeError: no kernel" in caplog.text
  assert "candidate ring failed elsewhere (process 1: lost); skipped here too" in caplog.text


def test_union_names_each_failure_with_the_processes_that_saw_it():
  got = autotune.union([{"ring": "no memory"}, {}, {"xla": "hung", "ring": "no memory"},
                      {"ring": "other"}])
  assert got == {"ring": "processes 0, 2: no memory; process 3: other", "xla": "process 2: hung"}
  assert list(got) == ["ring", "xla"]  # as process 0, then the others, saw them
  assert autotune.union([{}, {}]) == {}
  assert autotune.union([{"ring": "no memory"}]) == {"ring": "no memory"}  # one process


def test_union_of_failures_publishes_each_exchange_under_its_own_key(monkeypatch):
  """autotune's and autotune_step's `agree`: each process publishes the
  failures it saw in one step, under a key of its own for each exchange, and
  all take the union; `failed` keeps every failure agreed so far."""
  store = {autotune.kv.key(7, 2, "step", "failed", 0, 1): '{"ring": "no memory"}',
           autotune.kv.key(7, 2, "step", "failed", 1, 1): '{}'}
  monkeypatch.setattr(autotune.kv, "multi_process", lambda: True)
  monkeypatch.setattr(autotune.kv, "publish", store.__setitem__)

  def fetch(name, timeout):
    if name not in store:
      raise TimeoutError(f"no value for {name!r}")
    return store[name]

  monkeypatch.setattr(autotune.kv, "fetch", fetch)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  agree = autotune.UnionOfFailures(7, 2, "step", "failed", timeout=1.0)
  assert agree({"bad": "raised"}) == {"bad": "process 0: raised", "ring": "process 1: no memory"}
  assert store[autotune.kv.key(7, 2, "step", "failed", 0, 0)] == '{"bad": "raised"}'
  assert agree({}) == {}
  assert agree.failed == {"bad": "process 0: raised", "ring": "process 1: no memory"}
  # A peer that never answers (dead, or stuck in a collective): a timeout, not a hang.
  with pytest.raises(TimeoutError, match=r"exchange 2 \(step/failed\) within 1 s"):
    agree({})
  monkeypatch.setattr(autotune.kv, "multi_process", lambda: False)
  assert agree({"x": "raised"}) == {"x": "raised"}  # one process: nothing to agree on


class _Hang(BaseException):
  """A simulated collective that its peer never joined (not an Exception, so
  that no candidate's failure handling swallows it)."""


def _simulated_processes(monkeypatch, processes=2):
  """A FakeJob (threads over one key-value store) whose candidates are
  collectives: a call completes only when every process makes the same one,
  and each process's sequence of calls is recorded."""
  job = FakeJob(processes)
  monkeypatch.setattr(autotune.kv, "publish", job.publish)
  monkeypatch.setattr(autotune.kv, "fetch", job.fetch)
  monkeypatch.setattr(autotune.kv, "multi_process", lambda: True)
  monkeypatch.setattr(jax, "process_index", lambda: job.me.index)
  monkeypatch.setattr(jax, "process_count", lambda: job.processes)
  job.calls = [[] for _ in range(processes)]
  counts = [0] * processes
  barriers, lock = {}, threading.Lock()

  def collective(name):
    me = job.me.index
    job.calls[me].append(name)
    counts[me] += 1
    with lock:  # the n-th collective of every process meets the n-th of the others
      barrier = barriers.setdefault(counts[me], threading.Barrier(processes, timeout=5))
    try:
      barrier.wait()
    except threading.BrokenBarrierError:
      raise _Hang(f"process {me} left waiting in {name}") from None
    with lock:
      sequence = {calls[counts[me] - 1] for calls in job.calls}
    if len(sequence) > 1:
      raise _Hang(f"the processes ran unlike collectives: {sorted(sequence)}")
  job.collective = collective
  return job


@pytest.mark.parametrize("phase", ["build", "check", "time"])
def test_a_failure_in_one_process_only_is_skipped_by_every_process(monkeypatch, phase):
  """Process 1 alone sees "ring" fail: to build, with a wrong result, or in
  its second timed batch. Every process learns of it before the next
  collective and skips it: the processes run the same collectives (none is
  left waiting) and end with the same failures and the same choice."""
  job = _simulated_processes(monkeypatch)

  def candidate(name):
    def call():
      job.collective(name)
      if (phase == "time" and name == "ring" and jax.process_index() == 1
          and job.calls[1].count("ring") == 3):  # warm-up, a warm-up round, a timed one
        raise RuntimeError("ncclGetPeerDevicePointer: window argument is NULL")
      return name
    return (call, 1)

  def body(process):
    runs = {name: candidate(name) for name in ("xla", "ring", "pipelined_ce")}
    if phase == "build" and process == 1:
      runs["ring"] = "cublasMpMalloc failed: the requested functionality is not supported"
    verify = lambda name, out: ("differs from XLA's by 2" if phase == "check" and  # noqa: E731
                                name == "ring" and process == 1 else None)
    agree = autotune.UnionOfFailures(7, 1, "autotune", 0, "failed", timeout=5)
    times = autotune.time_candidates(runs, rounds=3, warmup_rounds=1,
                                     wait=lambda out: None, agree=agree, verify=verify)
    def decided(all_times):  # as autotune's measure decides
      choice, why = autotune.decide({name: [t[name] for t in all_times] for name in times})
      return [choice, autotune.with_failures(why, agree.failed)]

    choice = autotune.kv.leader_decides(7, 1, "autotune", 0, value=times, timeout_s=5,
                                        decide=decided)
    return sorted(name for name, t in times.items() if t == math.inf), agree.failed, choice

  got = job.run(body)
  assert job.calls[0] == job.calls[1]
  assert got[0] == got[1]
  failed, failures, (choice, why) = got[0]
  assert failed == ["ring"] and choice in ("xla", "pipelined_ce")
  assert list(failures) == ["ring"] and failures["ring"].startswith("process 1: ")
  assert why.endswith(f"; failed: ring ({failures['ring']})"), why
  expected = {"build": "cublasMpMalloc failed", "check": "wrong result: differs from XLA's by 2",
              "time": "ncclGetPeerDevicePointer: window argument is NULL"}[phase]
  assert expected in failures["ring"]


def test_autotune_step_where_every_plan_failed_raises_naming_each():
  """Every plan of the step fails (here to compile, in every process): there
  is nothing to choose, and every process raises the same error naming the
  step's XLA plan, the reference, and each plan and what it raised (with one
  process, no process is named)."""
  def step(x):
    raise ValueError("planted: the step cannot be traced")

  routes = {"ring": stand_in_plan(), "xla": stand_in_plan()}
  with pytest.raises(RuntimeError, match=r"the step under the all-XLA plan: XLA's run, .* "
                                         r"failed: xla \(planted: the step cannot be traced\), "
                                         r"ring \(planted: the step cannot be traced\)$"):
    autotune._measure(7, 1, routes, step, (jnp.ones(2),), 1, 1, timeout=1.0)


def test_build_compiles_now_and_returns_the_error_of_one_that_cannot_compile():
  calls = []
  run, iterations = autotune.build(lambda: "program", lambda program: calls.append(program), 3)
  run()
  assert calls == ["program"] and iterations == 3

  def broken():
    raise RuntimeError("\nINTERNAL: cublasMpMalloc failed\nmore lines")
  assert autotune.build(broken, None, 3) == "INTERNAL: cublasMpMalloc failed"
  assert autotune.message(RuntimeError()) == "RuntimeError"


def test_autotunes_candidates_are_compiled_before_any_runs(monkeypatch):
  """_runnables compiles each candidate, so a compile error is known (and
  agreed) before any process runs a candidate; its entry is the error."""
  real = CublasMpBackend.all_gather_matmul

  def refuse(self, *args, **kwargs):
    if self.all_gather_algorithm == "split_p2p":
      raise RuntimeError("planted: split_p2p cannot be lowered")
    return real(self, *args, **kwargs)

  monkeypatch.setattr(CublasMpBackend, "all_gather_matmul", refuse)
  runs = autotune._runnables(cpu_mesh(2), "tp", Problem(AG, 8, 8, 6, "float32", False, 2),
                             0.01, REGISTRY.plan())
  assert runs["cublasmp_split_p2p"] == "planted: split_p2p cannot be lowered"
  assert isinstance(runs["xla"], tuple) and isinstance(runs["cublasmp_default"], tuple)


def test_iterations_are_a_function_of_the_problem_alone():
  small = Problem(AG, 256, 256, 256, "bfloat16", False, 2)
  large = Problem(AG, 8192, 8192, 14336, "bfloat16", False, 2)
  assert autotune.iterations(small, 1.0) == 200
  assert 1 <= autotune.iterations(large, 1.0) < autotune.iterations(small, 1.0)
  # A batch is about a tenth of the seconds given: at ~400 TFLOP/s plus 30 us a
  # call, the large problem (2 * 16384 * 8192 * 14336 FLOP) takes ~9.65 ms.
  assert autotune.iterations(large, 1.0) == 10
  assert autotune.iterations(large, 3.0) == 31
  # Where the group has no symmetric memory (NCCL's network transport, as with
  # ranks sharing a GPU), a call costs milliseconds whatever its size: a batch
  # of 200 small calls would take 0.5 s, not the tenth of a second asked for.
  assert autotune.iterations(small, 1.0, symmetric_memory=False) == 39
  assert autotune.iterations(large, 1.0, symmetric_memory=False) == 8
  # There each of a ring's P - 1 steps pays it: 7 times at 8 ranks.
  small8 = dataclasses.replace(small, axis_size=8)
  assert autotune.iterations(small8, 1.0, symmetric_memory=False) == 5
  assert autotune.iterations(small8, 1.0) == 200


def test_timed_batches_follow_the_workspace_verdict(monkeypatch):
  """_runnables sizes its batches by connect's workspace verdict for the group."""
  p = Problem(AG, 8, 8, 6, "float32", False, 2)
  for ok, want in ((True, 200), (False, 3)):
    monkeypatch.setattr(autotune, "workspace",
                        lambda size, plan, ok=ok: Capability(ok, "planted"))
    runs = autotune._runnables(cpu_mesh(2), "tp", p, 0.1, REGISTRY.plan())
    assert runs["xla"][1] == want, (ok, runs["xla"][1])


@pytest.fixture
def empty_decisions(monkeypatch):
  """A plan in force where cuBLASMp runs, nothing measured."""
  REGISTRY.publish(stand_in_plan())


def test_rule_of_thumb_then_the_measured_choice(empty_decisions):
  """Unmeasured: the rule of thumb, with a warning that a program traced now
  keeps that route; measured: the choice, without one."""
  small = Problem(AG, 2048, 4096, 2048, "bfloat16", False, 2)
  large = Problem(AG, 4096, 8192, 4096, "bfloat16", False, 2)
  with pytest.warns(RuntimeWarning, match="keeps that route when autotune measures it"):
    assert routes.choose(small, "cublasmp_split_p2p", REGISTRY.plan())[0] == "xla"
  with pytest.warns(RuntimeWarning, match="is not measured"):
    name, why = routes.choose(large, "cublasmp_split_p2p", REGISTRY.plan())
  assert name == "cublasmp_split_p2p" and "not measured yet" in why
  REGISTRY.record_decisions({small: ("cublasmp_split_p2p", "measured: ...")})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert routes.choose(small, "xla", REGISTRY.plan()) == ("cublasmp_split_p2p", "measured: ...")


def test_no_warning_where_measuring_has_nothing_to_choose(empty_decisions):
  """A group of one has one candidate that runs (XLA's local GEMM): the rule of
  thumb's route is the only one, and tracing says nothing."""
  alone = Problem(AG, 2048, 4096, 2048, "bfloat16", False, 1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert routes.choose(alone, "cublasmp_split_p2p", REGISTRY.plan())[0] == "xla"


def test_no_warning_where_autotune_cannot_measure():
  """Without the extension (a CPU) autotune measures nothing: the warning's
  advice could not be followed, so tracing says nothing, FP8's two
  candidates (XLA, the ring) notwithstanding."""
  fp8 = Problem(AG, 64, 48, 48, "float32", False, 2, fp8=Fp8Recipe().key)
  assert not REGISTRY.plan().cublasmp.ok
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert routes.choose(fp8, "xla", REGISTRY.plan())[0] == "xla"



def test_settings_force_or_turn_off(empty_decisions):
  p = Problem(RS, 8192, 4096, 8192, "bfloat16", False, 2)
  measured = stand_in_plan().with_decisions({p: ("cublasmp_default", "measured")})
  assert routes.choose(p, "xla", measured) == ("cublasmp_default", "measured")
  forced = dataclasses.replace(measured, settings=Settings(autotune="ring"))
  assert routes.choose(p, "xla", forced) == ("ring", "forced by JAX_COMM_GEMM_AUTOTUNE=ring")
  off = dataclasses.replace(measured, settings=Settings(autotune="off"))
  assert routes.choose(p, "xla", off)[1].startswith("measuring is off")
  with pytest.raises(ValueError, match=r"JAX_COMM_GEMM_AUTOTUNE='fastest': allowed values"):
    Settings.from_environ({settings.AUTOTUNE: "fastest"})


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_the_environment_is_not_read_while_tracing(empty_decisions, monkeypatch):
  """Settings are read once (connect, or first use): a variable set later
  changes no route until the next connect publishes a plan with it."""
  p = Problem(RS, 8192, 4096, 8192, "bfloat16", False, 2)
  monkeypatch.setenv(settings.AUTOTUNE, "ring")
  assert routes.choose(p, "xla", REGISTRY.plan())[0] != "ring"


def _check_chosen_program(program, x, w, target: str, chosen: str, fused_calls: int):
  """`program` (x, w) -> x @ w runs `fused_calls` calls of `target` with the
  chosen algorithm's number, and gives x @ w."""
  jaxpr = str(jax.make_jaxpr(program)(x, w))
  assert jaxpr.count(target) == fused_calls
  if fused_calls:  # the chosen algorithm, by its number
    assert f"algorithm={jcg.config.ALGORITHMS[chosen.removeprefix('cublasmp_')]}" in jaxpr
  np.testing.assert_allclose(program(x, w), np.asarray(x) @ np.asarray(w), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("chosen, fused_calls", [("xla", 0), ("cublasmp_split_p2p", 1),
                                                 ("pipelined_ce", 1)])
def test_auto_backend_runs_the_chosen_implementation(empty_decisions, chosen, fused_calls):
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(0), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (8, 12), jnp.float32)
  REGISTRY.record_decisions({Problem(AG, 8, 8, 6, "float32", False, 2): (chosen, "test")})
  backend = bound(AutoBackend(CublasMpBackend()), REGISTRY.plan())

  def local(x, w):
    return backend.all_gather_matmul(x, w, "tp", transpose_w=False, return_gathered=False)

  program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                  out_specs=P(None, "tp")))
  _check_chosen_program(program, x, w, TARGETS["all_gather_matmul"], chosen, fused_calls)


@pytest.mark.parametrize("chosen, fused_calls", [("xla", 0), ("cublasmp_default", 1),
                                                 ("pipelined_ce", 1)])
def test_auto_backend_runs_the_chosen_reduce_scatter(empty_decisions, chosen, fused_calls):
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(2), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(3), (8, 12), jnp.float32)
  REGISTRY.record_decisions({Problem(RS, 16, 4, 12, "float32", False, 2): (chosen, "test")})
  backend = bound(AutoBackend(CublasMpBackend()), REGISTRY.plan())

  def local(x, w):
    return backend.matmul_reduce_scatter(x, w, "tp", transpose_w=False)

  program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
                                  out_specs=P("tp")))
  _check_chosen_program(program, x, w, TARGETS["matmul_reduce_scatter"], chosen, fused_calls)


def test_auto_backend_reuse_needs_every_fused_candidate_verified(monkeypatch):
  REGISTRY.publish(stand_in_plan())
  verdict = bound(AutoBackend(CublasMpBackend()), REGISTRY.plan()).gathered_reuse(
      2, jnp.bfloat16, True)
  assert not verdict.ok and "no self-test covered it" in verdict.reason
  monkeypatch.setattr(plan_lib.Plan, "verdict", lambda self, key: Capability(True, "ok"))
  assert bound(AutoBackend(CublasMpBackend()), REGISTRY.plan()).gathered_reuse(
      2, jnp.bfloat16, True).ok


def test_autotune_without_cublasmp_does_nothing():
  assert autotune.autotune(cpu_mesh(2), "tp") == {}


def test_auto_with_every_choice_xla_is_exactly_the_xla_program(monkeypatch):
  """Where autotune chose XLA for every op, backend="auto" lowers to the very
  program backend="xla" does (the MLP's gradient; locations aside): whatever
  separates them in a timing is the measurement, not the program."""
  mesh = cpu_mesh(2)
  REGISTRY.publish(stand_in_plan(autotune="xla").with_axis(mesh, "tp", 1, {}))
  monkeypatch.setattr(plan_lib.Plan, "verdict", lambda self, key: Capability(True, "stand-in"))
  x, w1, w2 = (jax.random.normal(jax.random.key(i), s, jnp.float32)
               for i, s in enumerate([(16, 8), (8, 12), (12, 8)]))
  texts = {}
  for name in ("auto", "xla"):
    config = jcg.CommGemmConfig(backend=name)
    assert type(jcg.backends.choose_backend(config, "tp", mesh).backend).__name__ == (
        "AutoBackend" if name == "auto" else "XlaBackend")

    def loss(x, w1, w2, config=config):
      f = jax.shard_map(lambda x, a, b: dense.mlp(x, a, b, axis_name="tp", config=config),
                        mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                        out_specs=P("tp"))
      return jnp.sum(f(x, w1, w2) ** 2)

    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, w1, w2).as_text()
    texts[name] = re.sub(r"loc\(.*?\)|#loc\d*", "", text)
  assert texts["auto"] == texts["xla"]


def test_a_call_that_returns_the_gathered_operand_is_its_own_problem(empty_decisions):
  """The gathered operand costs the implementations unlike amounts (free for
  XLA, a copy for cuBLASMp, an assembly for the ring), so a call that asks
  for it is measured as its own problem, and takes that problem's choice."""
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(4), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(5), (8, 12), jnp.float32)
  plain = Problem(AG, 8, 8, 6, "float32", False, 2)
  gathered = Problem(AG, 8, 8, 6, "float32", False, 2, gathered=True)
  assert gathered.text() == plain.text() + " +gathered"
  REGISTRY.record_decisions({gathered: ("ring", "test"), plain: ("xla", "test")})
  backend = bound(AutoBackend(CublasMpBackend()), REGISTRY.plan())

  def program(return_gathered):
    def local(x, w):
      return backend.all_gather_matmul(x, w, "tp", transpose_w=False,
                                       return_gathered=return_gathered)
    out = (P(None, "tp"), P("tp")) if return_gathered else P(None, "tp")
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=out))

  # The ring's ppermute in the call with the gathered operand; XLA's
  # all-gather in the other.
  assert "ppermute" in str(jax.make_jaxpr(program(True))(x, w))
  text = str(jax.make_jaxpr(program(False))(x, w))
  assert "ppermute" not in text and "all_gather" in text
  y, g = program(True)(x, w)
  np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(g)[:16], np.asarray(x))  # a gathered copy: exact


def test_the_disk_cache_section_names_every_candidate(monkeypatch):
  """A choice measured before an implementation was added is stale: the
  cache's section for it changes with the candidates (and the method)."""
  class Native:
    def cublasmp_version(self):
      return 1000

    def nccl_version(self):
      return 23203

  monkeypatch.setattr(REGISTRY, "_native", Native())
  before = autotune.signature()
  assert f"timing {autotune.METHOD}|" in before
  monkeypatch.setitem(routes.CANDIDATES, AG, routes.CANDIDATES[AG] + ("new_one",))
  assert autotune.signature() != before


def test_autotune_times_the_gathered_problem_with_its_operand_out():
  """autotune's candidate programs for a problem with the gathered operand
  return it, as the calls they stand for do."""
  mesh = cpu_mesh(2)
  for gathered, outputs in ((False, 1), (True, 2)):
    p = Problem(AG, 8, 8, 6, "float32", False, 2, gathered=gathered)
    runs = autotune._runnables(mesh, "tp", p, 0.01, REGISTRY.plan())
    out = runs["xla"][0]()
    got = jax.tree.leaves(out)
    assert len(got) == outputs
    assert got[0].shape == (16, 12)
    if gathered:
      assert got[1].shape == (32, 8)  # every device's [16, 8], stacked by the out spec


def test_a_candidate_with_a_wrong_result_is_left_out_everywhere(caplog):
  """Each warm-up result goes to `verify`; a wrong one fails its candidate
  (agreed with the other processes right after its warm-up) with the reason
  in the log. One that raised is not verified."""
  seen, agreed = [], []

  def judge(name, out):
    seen.append((name, out))
    return "differs from XLA's by 2" if name == "wrong" else None

  def broken():
    raise RuntimeError("cublasMpMatmul failed")

  times = autotune.time_candidates(
      {"xla": (lambda: "x", 1), "wrong": (lambda: "w", 1), "broken": (broken, 1)},
      rounds=2, wait=lambda out: None, verify=judge,
      agree=lambda failed: agreed.append(dict(failed)) or failed)
  assert seen == [("xla", "x"), ("wrong", "w")]
  # Building, then each warm-up; then xla's two timed batches.
  assert agreed == [{}, {}, {"wrong": "wrong result: differs from XLA's by 2"},
                    {"broken": "cublasMpMatmul failed"}, {}, {}]
  assert times["wrong"] == times["broken"] == math.inf and math.isfinite(times["xla"])
  assert "candidate wrong gave a wrong result: differs from XLA's by 2" in caplog.text


def _sharded(mesh, host):
  return jax.device_put(host, jax.sharding.NamedSharding(mesh, P("tp")))


def test_mismatch_compares_each_shard_with_xlas():
  mesh = cpu_mesh(2)
  y = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
  close = y + 1e-3 * np.abs(y).max()
  assert autotune.mismatch(_sharded(mesh, close), _sharded(mesh, y)) is None
  # Relative to the values' size: large sums rounded alike agree too.
  assert autotune.mismatch(_sharded(mesh, 1e4 * close), _sharded(mesh, 1e4 * y)) is None
  assert autotune.mismatch((_sharded(mesh, y), _sharded(mesh, y)),
                           (_sharded(mesh, y), _sharded(mesh, y))) is None
  stale = y.copy()
  stale[5] = 0.0  # a row of the second shard never written
  why = autotune.mismatch(_sharded(mesh, stale), _sharded(mesh, y))
  assert why.startswith("differs from XLA's by") and "on device 1" in why
  nan = y.copy()
  nan[0, 0] = np.nan
  assert "on device 0" in autotune.mismatch(_sharded(mesh, nan), _sharded(mesh, y))
  assert autotune.mismatch(_sharded(mesh, y[:4]), _sharded(mesh, y)) == \
      "shape (4, 4), XLA's (8, 4)"


def test_mismatch_holds_a_noise_leaf_to_the_largest_leafs_scale():
  """A step's gradient of a key bias is rounding noise (softmax makes it zero):
  two summation orders differ by all of it, which is no error; a leaf that
  differs by more than the noise of the result's largest leaf still is."""
  mesh = cpu_mesh(2)
  rng = np.random.default_rng(1)
  y = rng.standard_normal((8, 4)).astype(np.float32)
  noise = (6e-7 * rng.standard_normal((8, 4))).astype(np.float32)
  xla = (_sharded(mesh, y), _sharded(mesh, noise))
  assert autotune.mismatch((_sharded(mesh, y), _sharded(mesh, -noise)), xla) is None
  wrong = (_sharded(mesh, y), _sharded(mesh, noise + 1e-3))
  assert "differs from XLA's by 0.001" in autotune.mismatch(wrong, xla)
  assert 1e-3 > autotune.NOISE * np.abs(y).max() > 6e-7
  # Alone, the noise leaf is its own scale: a 100% difference is wrong.
  assert autotune.mismatch(_sharded(mesh, -noise), _sharded(mesh, noise)) is not None


def test_against_xla_takes_xlas_result_as_the_reference(monkeypatch):
  compared = []
  monkeypatch.setattr(autotune, "mismatch", lambda out, ref: compared.append((out, ref)))
  check = autotune.against_xla()
  assert check("ring", "r0") is None and compared == []  # XLA has not run (it failed)
  check("xla", "x")
  check("ring", "r")
  assert compared == [("r", "x")]


def test_xla_is_every_ops_first_candidate():
  """against_xla needs XLA's result before the others'."""
  assert all(names[0] == "xla" for names in routes.CANDIDATES.values())


def test_the_names_autotune_may_force_are_autos_candidates():
  """JAX_COMM_GEMM_AUTOTUNE is checked against settings.IMPLEMENTATIONS,
  without importing the backends: the two lists must name the same."""
  assert set(routes.CANDIDATES[AG]) | set(routes.CANDIDATES[RS]) == set(settings.IMPLEMENTATIONS)


@pytest.mark.parametrize("argument", ["rounds", "iterations"])
@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_autotune_step_refuses_a_count_that_measures_nothing(argument, value):
  """rounds=0 would time nothing and keep (and cache) an unmeasured plan:
  refused before any work, naming the argument."""
  with pytest.raises(ValueError, match=rf"autotune_step: `{argument}` must be a whole number "
                                       rf"of at least 1, got {value}"):
    autotune.autotune_step(cpu_mesh(2), "tp", lambda x: x, jnp.ones(2), **{argument: value})


def test_a_failed_xla_reference_run_is_an_error_naming_the_problem():
  """XLA's run is the reference every candidate is checked against: where it
  fails (here in its warm-up) nothing can be checked or chosen, and every
  process raises alike, naming what was measured and why XLA failed, before
  any other candidate runs."""
  ran = []

  def xla():
    raise RuntimeError("planted: XLA's program ran out of memory")

  with pytest.raises(RuntimeError, match=r"jax_comm_gemm autotune: all_gather_matmul rows=8: "
                                         r"XLA's run, the reference .* failed: xla \(planted: "
                                         r"XLA's program ran out of memory\)"):
    autotune.time_candidates({"xla": (xla, 1), "ring": (lambda: ran.append("ring"), 1)},
                             rounds=2, wait=lambda out: None, reference="xla",
                             about="all_gather_matmul rows=8")
  assert ran == []
  # XLA's program that does not build is the same error.
  with pytest.raises(RuntimeError, match=r"the step: XLA's run, the reference .* failed: "
                                         r"xla \(cannot compile\)"):
    autotune.time_candidates({"xla": "cannot compile", "ring": (lambda: "r", 1)}, rounds=2,
                             wait=lambda out: None, reference="xla", about="the step")


def test_autotune_step_whose_all_xla_step_fails_raises_naming_it():
  """The all-XLA step is the reference the other plans' results are checked
  against: where it fails (here to trace) and another plan runs, that plan is
  not kept unchecked; the error names the step's XLA plan and its failure."""
  xla_plan = stand_in_plan(autotune="off")
  routes = {"ring": stand_in_plan(), "xla": xla_plan}

  def step(x):
    if REGISTRY.plan() is xla_plan:
      raise ValueError("planted: the XLA step cannot be traced")
    return x + 1

  with pytest.raises(RuntimeError, match=r"the step under the all-XLA plan: XLA's run, the "
                                         r"reference .* failed: xla \(planted: the XLA step "
                                         r"cannot be traced\)"):
    autotune._measure(7, 1, routes, step, (jnp.ones(2),), 1, 1, timeout=1.0)
