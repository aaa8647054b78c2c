"""backend="auto": the choice per problem, and how autotune makes it.

The selection logic runs on CPU with a fake timer and stand-in candidates; the
AutoBackend's dispatch is seen in the traced program (on CPU the cuBLASMp
primitive lowers to XLA's collectives, so the numbers are checked too).
"""

import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh
from jax_comm_gemm import dense
import jax_comm_gemm.backends.tuning as autotune
import jax_comm_gemm.backends.verify as verify
from jax_comm_gemm.backends import auto
from jax_comm_gemm.backends.auto import AG, RS, AutoBackend, Problem
from jax_comm_gemm.backends.cublasmp import CublasMpBackend
from jax_comm_gemm.runtime import REGISTRY, settings
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.runtime.settings import Settings
from conftest import stand_in_plan
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


def test_time_candidates_skips_what_any_process_failed_to_run(caplog):
  """A candidate that failed to warm up in another process is skipped here
  too (the processes agree on the failed set before timing): running a
  collective candidate that a peer skips would leave this process waiting.
  Each failure is logged with its error."""
  ran = []

  def runner(name, fail=False):
    def call():
      ran.append(name)
      if fail:
        raise RuntimeError("cublasMpMatmul failed: not supported")
    return call

  seen = []

  def agree(failed):  # this process failed "bad"; a peer failed "ring"
    seen.append(set(failed))
    return set(failed) | {"ring"}

  with caplog.at_level("WARNING", logger="jax_comm_gemm.autotune"):
    times = autotune.time_candidates(
        {"xla": (runner("xla"), 1), "ring": (runner("ring"), 1),
         "bad": (runner("bad", fail=True), 1)}, rounds=2, wait=lambda out: None, agree=agree)
  assert seen == [{"bad"}]
  assert times["ring"] == times["bad"] == math.inf and math.isfinite(times["xla"])
  assert ran == ["xla", "ring", "bad", "xla", "xla"]  # warm-up, then only xla timed
  assert "candidate bad failed: cublasMpMatmul failed: not supported" in caplog.text


def test_union_of_failures_publishes_this_process_and_skips_every_process(monkeypatch):
  """autotune's and autotune_step's `agree`: each process publishes what it
  failed to warm up, under its own key, and all skip the union."""
  store = {autotune.kv.key(7, 2, "step", "failed", 1): '["ring"]'}
  monkeypatch.setattr(autotune.kv, "multi_process", lambda: True)
  monkeypatch.setattr(autotune.kv, "publish", store.__setitem__)
  monkeypatch.setattr(autotune.kv, "fetch", lambda name, timeout: store[name])
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  agree = autotune.union_of_failures(7, 2, "step", "failed", timeout=1.0)
  assert agree({"bad"}) == {"bad", "ring"}
  assert store[autotune.kv.key(7, 2, "step", "failed", 0)] == '["bad"]'
  monkeypatch.setattr(autotune.kv, "multi_process", lambda: False)
  assert agree({"x"}) == {"x"}  # one process: nothing to agree on


def test_iterations_are_a_function_of_the_problem_alone():
  small = Problem(AG, 256, 256, 256, "bfloat16", False, 2)
  large = Problem(AG, 8192, 8192, 14336, "bfloat16", False, 2)
  assert autotune.iterations(small, 1.0) == 200
  assert 1 <= autotune.iterations(large, 1.0) < autotune.iterations(small, 1.0)
  # A batch is about a tenth of the seconds given: at ~400 TFLOP/s plus 30 us a
  # call, the large problem (2 * 16384 * 8192 * 14336 FLOP) takes ~9.65 ms.
  assert autotune.iterations(large, 1.0) == 10
  assert autotune.iterations(large, 3.0) == 31


@pytest.fixture
def empty_decisions(monkeypatch):
  """A plan in force where cuBLASMp runs, nothing measured, nothing wanted."""
  monkeypatch.setattr(REGISTRY, "_wanted", {})
  plan_lib.publish(stand_in_plan())


def test_rule_of_thumb_and_wanted(empty_decisions):
  small = Problem(AG, 2048, 4096, 2048, "bfloat16", False, 2)
  large = Problem(AG, 4096, 8192, 4096, "bfloat16", False, 2)
  assert auto.choose(small, "cublasmp_split_p2p")[0] == "xla"
  name, why = auto.choose(large, "cublasmp_split_p2p")
  assert name == "cublasmp_split_p2p" and "not measured yet" in why
  assert REGISTRY.wanted() == [small, large]
  REGISTRY.record_decisions({small: ("cublasmp_split_p2p", "measured: ...")})
  assert auto.choose(small, "xla") == ("cublasmp_split_p2p", "measured: ...")
  assert REGISTRY.wanted() == [large]


def test_settings_force_or_turn_off(empty_decisions):
  p = Problem(RS, 8192, 4096, 8192, "bfloat16", False, 2)
  measured = stand_in_plan().with_decisions({p: ("cublasmp_default", "measured")})
  assert auto.choose(p, "xla", measured) == ("cublasmp_default", "measured")
  forced = dataclasses.replace(measured, settings=Settings(autotune="ring"))
  assert auto.choose(p, "xla", forced) == ("ring", "forced by JAX_COMM_GEMM_AUTOTUNE=ring")
  off = dataclasses.replace(measured, settings=Settings(autotune="off"))
  assert auto.choose(p, "xla", off)[1].startswith("measuring is off")
  with pytest.raises(ValueError, match=r"JAX_COMM_GEMM_AUTOTUNE='fastest': allowed values"):
    Settings.from_environ({settings.AUTOTUNE: "fastest"})


def test_the_environment_is_not_read_while_tracing(empty_decisions, monkeypatch):
  """Settings are read once (connect, or first use): a variable set later
  changes no route until the next connect publishes a plan with it."""
  p = Problem(RS, 8192, 4096, 8192, "bfloat16", False, 2)
  monkeypatch.setenv(settings.AUTOTUNE, "ring")
  assert auto.choose(p, "xla")[0] != "ring"


def _check_chosen_program(program, x, w, target: str, chosen: str, fused_calls: int):
  """`program` (x, w) -> x @ w runs `fused_calls` calls of `target` with the
  chosen algorithm's number, and gives x @ w."""
  jaxpr = str(jax.make_jaxpr(program)(x, w))
  assert jaxpr.count(target) == fused_calls
  if fused_calls:  # the chosen algorithm, by its number
    assert f"algorithm={jcg.ALGORITHMS[chosen.removeprefix('cublasmp_')]}" in jaxpr
  np.testing.assert_allclose(program(x, w), np.asarray(x) @ np.asarray(w), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("chosen, fused_calls", [("xla", 0), ("cublasmp_split_p2p", 1),
                                                 ("pipelined", 1), ("pipelined_ce", 1)])
def test_auto_backend_runs_the_chosen_implementation(empty_decisions, chosen, fused_calls):
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(0), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (8, 12), jnp.float32)
  REGISTRY.record_decisions({Problem(AG, 8, 8, 6, "float32", False, 2): (chosen, "test")})
  backend = AutoBackend(CublasMpBackend())

  def local(x, w):
    return backend.all_gather_matmul(x, w, "tp", transpose_w=False, return_gathered=False)

  program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                  out_specs=P(None, "tp")))
  _check_chosen_program(program, x, w, TARGETS["all_gather_matmul"], chosen, fused_calls)


@pytest.mark.parametrize("chosen, fused_calls", [("xla", 0), ("cublasmp_default", 1),
                                                 ("pipelined", 1), ("pipelined_ce", 1)])
def test_auto_backend_runs_the_chosen_reduce_scatter(empty_decisions, chosen, fused_calls):
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(2), (16, 8), jnp.float32)
  w = jax.random.normal(jax.random.key(3), (8, 12), jnp.float32)
  REGISTRY.record_decisions({Problem(RS, 16, 4, 12, "float32", False, 2): (chosen, "test")})
  backend = AutoBackend(CublasMpBackend())

  def local(x, w):
    return backend.matmul_reduce_scatter(x, w, "tp", transpose_w=False)

  program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
                                  out_specs=P("tp")))
  _check_chosen_program(program, x, w, TARGETS["matmul_reduce_scatter"], chosen, fused_calls)


def test_auto_backend_reuse_needs_every_fused_candidate_verified(monkeypatch):
  plan_lib.publish(stand_in_plan())
  verdict = AutoBackend(CublasMpBackend()).gathered_reuse(2, jnp.bfloat16, True)
  assert not verdict.ok and "no self-test covered it" in verdict.reason
  monkeypatch.setattr(plan_lib.Plan, "verdict", lambda self, key: Capability(True, "ok"))
  assert AutoBackend(CublasMpBackend()).gathered_reuse(2, jnp.bfloat16, True).ok


def test_autotune_without_cublasmp_does_nothing():
  assert autotune.autotune(cpu_mesh(2), "tp") == {}


def test_auto_with_every_choice_xla_is_exactly_the_xla_program(monkeypatch):
  """Where autotune chose XLA for every op, backend="auto" lowers to the very
  program backend="xla" does (the MLP's gradient; locations aside): whatever
  separates them in a timing is the measurement, not the program."""
  mesh = cpu_mesh(2)
  plan_lib.publish(stand_in_plan(autotune="xla").with_axis(mesh, "tp", 1, {}))
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
  backend = AutoBackend(CublasMpBackend())

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


def test_the_fused_weight_gradient_takes_the_gathered_problems_choice(empty_decisions,
                                                                    monkeypatch):
  """The row-parallel backward's one call (dgrad AllGather+GEMM and wgrad)
  reads the gathered operand, so it runs the choice of the problem with the
  operand out, as weight_gradient_fusion asked it; the plain problem's choice
  (here XLA, which has no such call) is not consulted."""
  mesh = cpu_mesh(2)
  REGISTRY.record_decisions({
      Problem(AG, 8, 8, 6, "float32", False, 2, gathered=True): ("cublasmp_default", "test"),
      Problem(AG, 8, 8, 6, "float32", False, 2): ("xla", "test")})
  ran = []

  def fused(self, x, w, h, axis_name, *, transpose_w, precision=None):
    ran.append(self.all_gather_algorithm)
    return jnp.zeros((16, 6), x.dtype), jnp.zeros(w.shape, w.dtype)

  monkeypatch.setattr(CublasMpBackend, "all_gather_matmul_weight_gradient", fused)
  backend = AutoBackend(CublasMpBackend())

  def local(x, w, h):
    return backend.all_gather_matmul_weight_gradient(x, w, h, "tp", transpose_w=False)

  x, w, h = jnp.ones((16, 8)), jnp.ones((8, 12)), jnp.ones((32, 12))
  jax.make_jaxpr(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp"),
                                                              P(None, "tp")),
                               out_specs=(P(None, "tp"), P(None, "tp"))))(x, w, h)
  assert ran == ["default"]


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
  monkeypatch.setitem(auto.CANDIDATES, AG, auto.CANDIDATES[AG] + ("new_one",))
  assert autotune.signature() != before


def test_autotune_times_the_gathered_problem_with_its_operand_out():
  """autotune's candidate programs for a problem with the gathered operand
  return it, as the calls they stand for do."""
  mesh = cpu_mesh(2)
  for gathered, outputs in ((False, 1), (True, 2)):
    p = Problem(AG, 8, 8, 6, "float32", False, 2, gathered=gathered)
    runs = autotune._runnables(mesh, "tp", p, seconds=0.01)
    out = runs["xla"][0]()
    got = jax.tree.leaves(out)
    assert len(got) == outputs
    assert got[0].shape == (16, 12)
    if gathered:
      assert got[1].shape == (32, 8)  # every device's [16, 8], stacked by the out spec


def test_a_candidate_with_a_wrong_result_is_left_out_everywhere(caplog):
  """Each warm-up result goes to `verify`; a wrong one fails its candidate
  (in the set the processes agree on) with the reason in the log. One that
  raised is not verified."""
  seen, agreed = [], []

  def judge(name, out):
    seen.append((name, out))
    return "differs from XLA's by 2" if name == "wrong" else None

  def broken():
    raise RuntimeError("cublasMpMatmul failed")

  times = autotune.time_candidates(
      {"xla": (lambda: "x", 1), "wrong": (lambda: "w", 1), "broken": (broken, 1)},
      rounds=2, wait=lambda out: None, verify=judge,
      agree=lambda failed: agreed.append(set(failed)) or failed)
  assert seen == [("xla", "x"), ("wrong", "w")]
  assert agreed == [{"wrong", "broken"}]
  assert times["wrong"] == times["broken"] == math.inf and math.isfinite(times["xla"])
  assert "candidate wrong gave a wrong result: differs from XLA's by 2" in caplog.text


def _sharded(mesh, host):
  return jax.device_put(host, jax.sharding.NamedSharding(mesh, P("tp")))


def test_mismatch_compares_each_shard_with_xlas():
  mesh = cpu_mesh(2)
  y = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
  close = y + 1e-3 * np.abs(y).max()
  assert verify.mismatch(_sharded(mesh, close), _sharded(mesh, y)) is None
  # Relative to the values' size: large sums rounded alike agree too.
  assert verify.mismatch(_sharded(mesh, 1e4 * close), _sharded(mesh, 1e4 * y)) is None
  assert verify.mismatch((_sharded(mesh, y), _sharded(mesh, y)),
                           (_sharded(mesh, y), _sharded(mesh, y))) is None
  stale = y.copy()
  stale[5] = 0.0  # a row of the second shard never written
  why = verify.mismatch(_sharded(mesh, stale), _sharded(mesh, y))
  assert why.startswith("differs from XLA's by") and "on device 1" in why
  nan = y.copy()
  nan[0, 0] = np.nan
  assert "on device 0" in verify.mismatch(_sharded(mesh, nan), _sharded(mesh, y))
  assert verify.mismatch(_sharded(mesh, y[:4]), _sharded(mesh, y)) == \
      "shape (4, 4), XLA's (8, 4)"


def test_against_xla_takes_xlas_result_as_the_reference(monkeypatch):
  compared = []
  monkeypatch.setattr(verify, "mismatch", lambda out, ref: compared.append((out, ref)))
  check = verify.against_xla()
  assert check("ring", "r0") is None and compared == []  # XLA has not run (it failed)
  check("xla", "x")
  check("ring", "r")
  assert compared == [("r", "x")]


def test_xla_is_every_ops_first_candidate():
  """against_xla needs XLA's result before the others'."""
  assert all(names[0] == "xla" for names in auto.CANDIDATES.values())


def test_the_names_autotune_may_force_are_autos_candidates():
  """JAX_COMM_GEMM_AUTOTUNE is checked against settings.IMPLEMENTATIONS,
  without importing the backends: the two lists must name the same."""
  assert set(auto.CANDIDATES[AG]) | set(auto.CANDIDATES[RS]) == set(settings.IMPLEMENTATIONS)
