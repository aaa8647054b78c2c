"""``connect`` and the registry, with a stand-in for the C++ extension.

On CPU the real extension cannot load, so a FakeNative records what the
runtime asks of it. What is checked: which NCCL groups a mesh axis forms and
that each is made once; that tracing, ``jax.eval_shape`` and lowering for the
GPU make no communicator (so one process can lower alone); the settings read
from the environment; and that verdicts are looked up per transpose.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from jax_comm_gemm.backends.routes import AG, RS, Problem
from jax_comm_gemm.backends.routes import choose_backend
from jax_comm_gemm.backends.routes import bound, gathered_route
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.runtime import REGISTRY, agreement, capability, comm_id, settings
import jax_comm_gemm.backends.tuning as tuning
import jax_comm_gemm.runtime.communicators as connect_module
from jax_comm_gemm.runtime.capability import Capability, VerdictKey
from jax_comm_gemm.runtime.constants import TARGETS
from fake_native import fake_probe, install_fake_native


@pytest.fixture
def fake(monkeypatch):
  """REGISTRY with cuBLASMp "available" through FakeNative, emptied for the test."""
  return install_fake_native(monkeypatch)


def mesh_2x4():
  return Mesh(np.asarray(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))


def test_connect_makes_one_group_per_row_in_rank_order(fake):
  mesh = mesh_2x4()
  assert jcg.connect(mesh, "tp").ok
  (call,) = fake.connected
  assert [(n, members) for _, n, members in call["groups"]] == [
      (4, [(int(d.local_hardware_id), r) for r, d in enumerate(row)])
      for row in np.asarray(mesh.devices)]
  assert call["timeouts"] == (300.0, 300.0)
  assert call["time_gemms"] is True  # the own GEMMs' algorithms are timed by default
  (ident, device_groups), = fake.bound
  assert ident == comm_id(mesh, "tp") == REGISTRY.comm_id(mesh, "tp")
  assert sorted(d for d, _ in device_groups) == list(range(8))


@pytest.mark.parametrize("autotune, timed", [("off", False), ("OFF ", False), ("on", True),
                                             ("xla", True)])
def test_measuring_off_leaves_the_own_gemms_on_cublaslts_first_choice(fake, monkeypatch,
                                                                     autotune, timed):
  """JAX_COMM_GEMM_AUTOTUNE=off times nothing: neither the implementations
  nor the algorithm of each own GEMM (cuBLASLt's first heuristic choice)."""
  monkeypatch.setenv(settings.AUTOTUNE, autotune)
  assert jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)), "tp").ok
  assert fake.connected[0]["time_gemms"] is timed


def test_an_axis_of_size_one_runs_xla_without_a_word(fake, recwarn):
  """Nothing to communicate: every backend request, 'cublasmp' included,
  runs XLA there, and no warning says to connect (connect has nothing to do)."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]).reshape(2, 1), ("dp", "tp"))
  assert jcg.connect(mesh, "tp").ok and fake.connected == []
  for backend in ("auto", "cublasmp"):
    choice = choose_backend(jcg.CommGemmConfig(backend=backend), "tp", mesh)
    assert choice.backend.name == "xla" and "has size 1" in choice.reason
  assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_leading_tensor_parallel_axis_groups_the_columns(fake):
  """("tp", "dp") = (4, 2): each group is a column of the device grid (the
  devices that differ in "tp" alone), in "tp" order, whichever axis comes first."""
  devices = np.asarray(jax.devices("cpu")[:8]).reshape(4, 2)
  mesh = Mesh(devices, ("tp", "dp"))
  groups = connect_module.axis_groups(mesh, "tp")
  assert [[d.id for d in g] for g in groups] == [[d.id for d in devices[:, j]] for j in range(2)]
  assert jcg.connect(mesh, "tp").ok
  (call,) = fake.connected
  assert [(n, members) for _, n, members in call["groups"]] == [
      (4, [(int(d.local_hardware_id), r) for r, d in enumerate(devices[:, j])]) for j in range(2)]


def test_a_mesh_of_other_sizes_is_not_connected(fake):
  """The registry knows an axis by its names and sizes (all that trace time
  sees): connecting ("dp", "tp") = (2, 4) does not connect (4, 2)."""
  devices = np.asarray(jax.devices("cpu")[:8])
  connected = Mesh(devices.reshape(2, 4), ("dp", "tp"))
  assert jcg.connect(connected, "tp").ok
  assert REGISTRY.comm_id(connected, "tp") is not None
  assert REGISTRY.comm_id(Mesh(devices.reshape(4, 2), ("dp", "tp")), "tp") is None


def test_connect_is_idempotent_and_shares_groups(fake):
  devices = np.asarray(jax.devices("cpu")[:4])
  a = Mesh(devices, ("tp",))
  jcg.connect(a, "tp")
  jcg.connect(a, "tp")
  assert len(fake.connected) == 1 and len(fake.bound) == 1
  # Another mesh whose axis forms the same group binds it, and makes nothing new.
  jcg.connect(Mesh(devices.reshape(1, 4), ("dp", "tp")), "tp")
  assert len(fake.connected) == 1 and len(fake.bound) == 2


def test_a_failed_connect_can_be_retried(fake, monkeypatch):
  """The attempt number grows, so a retry's key-value keys are new."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  working = fake.connect

  def failing(*args):
    monkeypatch.setattr(fake, "connect", working)  # fails once
    raise RuntimeError("ncclCommInitRank failed: unhandled system error")

  monkeypatch.setattr(fake, "connect", failing)
  with pytest.raises(RuntimeError, match="ncclCommInitRank failed"):
    jcg.connect(mesh, "tp")
  assert REGISTRY.comm_id(mesh, "tp") is None
  jcg.connect(mesh, "tp")
  ident = comm_id(mesh, "tp")
  assert REGISTRY._attempts[ident] == 2
  assert connect_module.kv.key(ident, 2, "x").endswith("/attempt2/x")


def test_connect_without_cublasmp_does_nothing():
  """On CPU, connect answers why cuBLASMp cannot run, and raises nothing."""
  status = jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)), "tp")
  assert not status.ok and "cpu" in status.reason


def test_connect_checks_the_axis(fake):
  with pytest.raises(ValueError, match=r"connect: axis_name='model' is not an axis"):
    jcg.connect(mesh_2x4(), "model")


def _layer_program(mesh, backend):
  config = jcg.CommGemmConfig(backend=backend)

  def local(x, w):
    return jcg.all_gather_matmul(x, w, "tp", config=config)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                               out_specs=P(None, "tp")))


ARGS = (jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32))


def test_tracing_never_connects(fake):
  """Unconnected: 'cublasmp' is a trace-time error that says what to do, and
  'auto' runs XLA with a warning; neither makes a communicator."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  with pytest.raises(RuntimeError, match=r"not connected: call "
                     r"jax_comm_gemm.connect\(mesh, 'tp'\) in every process"):
    jax.eval_shape(_layer_program(mesh, "cublasmp"), *ARGS)
  with pytest.warns(RuntimeWarning, match="not connected"):
    jax.eval_shape(_layer_program(mesh, "auto"), *ARGS)
  assert fake.connected == [] and fake.bound == []


def test_lowering_for_gpu_alone_makes_no_communicator(fake):
  """After connect, eval_shape and lowering for CUDA (what one process does to
  dump HLO) only read the registry: the custom call carries comm_id, and no
  further connect or bind happens. Lowering needs no peer, so it cannot hang."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  before = (len(fake.connected), len(fake.bound))
  program = _layer_program(mesh, "cublasmp")
  jax.eval_shape(program, *ARGS)
  text = program.trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
  assert TARGETS["all_gather_matmul"] in text
  assert str(comm_id(mesh, "tp")) in text
  assert (len(fake.connected), len(fake.bound)) == before


@pytest.mark.filterwarnings("ignore:.*layout self-test failed:RuntimeWarning")  # on purpose
def test_verdicts_are_looked_up_per_transpose(fake, monkeypatch):
  """A verdict that passed for NN says nothing about TN: reuse is refused
  there, and the reason says which case was not verified."""
  monkeypatch.setattr(capability, "_probe", fake_probe(passing=lambda key: not key.transpose_w))
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  backend = bound(jcg.backends.CublasMpBackend(), REGISTRY.plan())
  assert gathered_route(backend, None, 2, jnp.bfloat16, False).reuse
  route = gathered_route(backend, None, 2, jnp.bfloat16, True)
  assert not route.reuse and route.reason == "fake self-test"
  # A case the self-test never ran (another group size) is refused with why.
  route = gathered_route(backend, None, 4, jnp.bfloat16, False)
  assert not route.reuse and "no self-test covered it" in route.reason
  assert "no self-test covered it" in REGISTRY.plan().verdict(
      VerdictKey(8, "split_p2p", "bfloat16", False, "front")).reason


def test_connect_self_tests_only_the_layout_it_reads(fake, monkeypatch):
  """The plan reads the layout of the cuBLASMp version (0.10: "tail"); the
  self-test runs that one alone, and the other stays untested."""
  layouts = []

  def probe(mesh, axis_name, ident, layout, version, cases):
    layouts.append(layout)
    return {case: Capability(True, "fake self-test") for case in cases}

  monkeypatch.setattr(capability, "_probe", probe)
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  assert REGISTRY.plan().layout == "tail" and set(layouts) == {"tail"}
  plan = REGISTRY.plan()
  assert plan.verdict(VerdictKey(2, "split_p2p", "bfloat16", True, "tail")).ok
  assert "no self-test covered it" in plan.verdict(
      VerdictKey(2, "split_p2p", "bfloat16", True, "front")).reason


@pytest.mark.parametrize("env, match", [
    ({"JAX_COMM_GEMM_FENCE": "isolated"},
     r"JAX_COMM_GEMM_FENCE is not a jax_comm_gemm setting any more: every cuBLASMp call"),
    ({"JAX_COMM_GEMM_BACKND": "xla"},
     r"JAX_COMM_GEMM_BACKND is not a jax_comm_gemm setting; the settings are "
     r"JAX_COMM_GEMM_BACKEND, "),
    ({"JAX_COMM_GEMM_BACKEND": "cuda"}, r"JAX_COMM_GEMM_BACKEND='cuda': allowed values are "
                                        r"\('auto', 'cublasmp', 'xla', 'ring'\)"),
    ({"JAX_COMM_GEMM_AUTOTUNE": "fast"}, r"JAX_COMM_GEMM_AUTOTUNE='fast': allowed values"),
    ({"JAX_COMM_GEMM_ON_ABORT": "retry"}, r"JAX_COMM_GEMM_ON_ABORT='retry': allowed values"),
    ({"JAX_COMM_GEMM_TIMEOUT": "soon"}, r"JAX_COMM_GEMM_TIMEOUT='soon' must be a positive"),
    ({"JAX_COMM_GEMM_TIMEOUT": "0"}, r"JAX_COMM_GEMM_TIMEOUT='0' must be a positive"),
    ({"JAX_COMM_GEMM_TIMEOUT": "-1"}, r"JAX_COMM_GEMM_TIMEOUT='-1' must be a positive"),
    ({"JAX_COMM_GEMM_TIMEOUT": "nan"}, r"JAX_COMM_GEMM_TIMEOUT='nan' must be a positive"),
    ({"JAX_COMM_GEMM_TIMEOUT": "inf"}, r"JAX_COMM_GEMM_TIMEOUT='inf' must be a positive"),
    ({"JAX_COMM_GEMM_ABORT_GRACE": "0"}, r"JAX_COMM_GEMM_ABORT_GRACE='0' must"),
    ({"JAX_COMM_GEMM_CONNECT_TIMEOUT": "-3"}, r"JAX_COMM_GEMM_CONNECT_TIMEOUT='-3' must"),
])
def test_bad_settings_fail_before_any_collective(fake, monkeypatch, env, match):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=match):
    jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)), "tp")
  assert fake.connected == []


@pytest.mark.parametrize("env", [{"JAX_COMM_GEMM_TIMEOUT": "-1"},
                                 {"JAX_COMM_GEMM_BACKEND": "fast"}])
def test_bad_settings_fail_at_connect_on_a_cpu_too(monkeypatch, env):
  """Where cuBLASMp cannot run, connect still reads and checks the settings."""
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=next(iter(env))):
    jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)), "tp")


def test_bad_settings_fail_at_first_use_without_connect(monkeypatch):
  """No connect: the settings are read, and checked, at the first trace."""
  monkeypatch.setattr(REGISTRY, "_first", None)
  REGISTRY.publish(None)
  monkeypatch.setenv("JAX_COMM_GEMM_TIMEOUT", "-1")
  with pytest.raises(ValueError, match="JAX_COMM_GEMM_TIMEOUT='-1'"):
    jax.eval_shape(_layer_program(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)),
                                  "auto"), *ARGS)


def test_connect_adopts_the_settings(fake, monkeypatch):
  """The settings that connect read are the plan's, and programs traced after
  it follow them (those traced before keep their routes:
  tests/test_explicit_plan.py)."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  x, w = jnp.ones((16, 8)), jnp.ones((8, 16))
  monkeypatch.setenv(settings.AUTOTUNE, "pipelined_ce")
  jcg.connect(mesh, "tp")
  assert REGISTRY.plan().settings.autotune == "pipelined_ce"
  program = _layer_program(mesh, "auto")
  assert TARGETS["all_gather_matmul"] in str(program.trace(x, w).jaxpr)
  np.testing.assert_allclose(program(x, w), np.full((16, 16), 8.0))  # sums of ones: exact


def test_fingerprints_compare_by_setting():
  """The message names each setting that differs and the processes on each side."""
  same = {"JAX_COMM_GEMM_BACKEND": "", "cuBLASMp version": "1000"}
  assert agreement.compare({0: same, 1: dict(same)}) is None
  message = agreement.compare({0: same, 1: {**same, "JAX_COMM_GEMM_BACKEND": "xla"},
                               2: dict(same)})
  assert ("JAX_COMM_GEMM_BACKEND differs (processes 0, 2: ''; process 1: 'xla')"
          in message)
  assert "cuBLASMp version" not in message
  assert "<missing>" in agreement.compare({0: same, 1: {"JAX_COMM_GEMM_BACKEND": ""}})


def test_report_follows_auto_on_a_connected_axis(fake):
  """backend='auto' on a connected axis runs the fused ops where measured
  faster; the report says so, and counts on reuse (GPU run 16 printed
  'xla fallback' here while the step held 8 fused calls)."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  row = report.layer_path(jcg.CommGemmConfig(), mesh, "tp", jnp.bfloat16,
                          reduce_scatter_layer=True)
  assert row.path == report.FUSED_WITH_REUSE and row.reason.startswith("backend='auto'")
  column = report.layer_path(jcg.CommGemmConfig(), mesh, "tp", jnp.bfloat16)
  assert column.path == report.FUSED_WITH_ALL_GATHER
  counts = report.expected_all_gathers(jcg.CommGemmConfig(), mesh, "tp", jnp.bfloat16)
  assert (counts.standalone_all_gathers, counts.fused_all_gather_matmuls) == (1, 2)


def _connected_mlp_step():
  """(mesh, step, args): the MLP's weight gradients on a connected 2-CPU mesh."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  args = [jax.random.normal(jax.random.key(i), s, jnp.float32)
          for i, s in enumerate([(16, 8), (8, 32), (32, 8)])]

  def step(x, w1, w2):
    local = jax.shard_map(lambda x, a, b: jcg.mlp(x, a, b, axis_name="tp"), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return jax.grad(lambda a, b: jnp.sum(local(x, a, b) ** 2), (0, 1))(w1, w2)
  return mesh, step, args


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_step_level_choice_takes_the_fastest_plan(fake, monkeypatch):
  """autotune_step measures the ops of a step, then the step under each plan:
  the per-op choices, and every op on one implementation (XLA among them).
  The tuned step's routes hold the plan taken for every op (each op may
  measure faster fused while the step is slower, and the reverse)."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  mesh, step, (x, w1, w2) = _connected_mlp_step()

  # Each op measures fastest on split_p2p, except the backward RS on the ring:
  # the per-op plan mixes two implementations.
  def per_op(times):
    return ("ring", "fake") if len(decided) == 3 else ("cublasmp_split_p2p", "fake")
  decided = []
  monkeypatch.setattr(tuning, "decide", lambda times: decided.append(1) or per_op(times))
  # decide is faked alike in every round, so the ops' choices are the same in
  # each: they are measured (their candidates compiled and run) in the first
  # round, and the later rounds reuse them.
  real_measure, measured, asked = tuning.measure, {}, []

  def measure_once(mesh, axis_name, problems, plan, **kw):
    asked.append(tuple(problems))
    if asked[-1] not in measured:
      measured[asked[-1]] = real_measure(mesh, axis_name, problems, plan, **kw)
    return measured[asked[-1]]

  monkeypatch.setattr(tuning, "measure", measure_once)
  timed, firsts, verifiers = [], [], []
  real_time = tuning.time_candidates

  def time_steps(runs, rounds, f, **kw):  # the step's plans faked, the ops' timed
    if "step" not in kw["agree"]._key:
      return real_time(runs, rounds=rounds, **kw)
    return (timed.append(sorted(runs)) or firsts.append(next(iter(runs)))
            or verifiers.append(kw["verify"])
            or {name: (1e-3 if name == f else 2e-3) for name in runs}
            if kw["agree"]({"ring": "x"}) == {"ring": "x"} and kw["warmup_rounds"] > 0
            else None)

  for faster in ("tuned", "xla", "pipelined_ce", "cublasmp_split_p2p"):
    decided.clear()
    monkeypatch.setattr(tuning, "time_candidates",
                        lambda runs, rounds, f=faster, **kw: time_steps(runs, rounds, f, **kw))
    tuned = jcg.autotune_step(mesh, "tp", step, x, w1, w2, seconds_per_problem=1e-5)
    plan, why = tuned.plan, tuned.why
    assert plan == faster and why.startswith("step measured"), why
    problems = jcg.backends.problems_of(step, x, w1, w2)
    assert len(problems) >= 4  # fwd AG and RS, bwd AG (TN) and RS
    taken = {tuned.routes.decision(p)[0] for p in problems}
    assert taken == ({"cublasmp_split_p2p", "ring"} if faster == "tuned" else {faster})
  assert len(asked) == 4 and len(measured) == 1  # every round asked, for the same ops
  # Every plan was timed: the AG-only "pallas_mgpu" cannot run the step's RS.
  assert timed[0] == sorted(["tuned", "xla", "ring", "cublasmp_default", "cublasmp_split_p2p",
                             "pipelined_ce"])
  # XLA's step first, and the others' results checked against its.
  assert set(firsts) == {"xla"}
  grads = step(x, w1, w2)
  verify = verifiers[0]
  assert verify("xla", grads) is None and verify("tuned", grads) is None
  assert "differs from XLA's" in verify("ring", jax.tree.map(lambda g: 2 * g, grads))


def test_step_plan_is_cached_on_disk(fake, monkeypatch, tmp_path):
  """The step's plan is kept in autotune's disk cache: the next autotune_step
  of the same step takes it without compiling or timing the step; other plans
  (implementations=) measure anew."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
  mesh, step, (x, w1, w2) = _connected_mlp_step()

  monkeypatch.setattr(tuning, "decide", lambda times: ("cublasmp_split_p2p", "fake"))
  timed = []
  monkeypatch.setattr(tuning, "time_candidates", lambda runs, rounds, agree, **_: (
      ("step" in agree._key and timed.append(sorted(runs)))
      or {n: (1e-3 if n == "pipelined_ce" else 2e-3) for n in runs}))
  first = jcg.autotune_step(mesh, "tp", step, x, w1, w2, seconds_per_problem=1e-5)
  compiled = []
  monkeypatch.setattr(tuning, "_measure", lambda *a: compiled.append(a) or ("xla", "?"))
  again = jcg.autotune_step(mesh, "tp", step, x, w1, w2, seconds_per_problem=1e-5)
  assert first.plan == again.plan == "pipelined_ce" and not compiled
  assert again.why == first.why + " (cached)"
  assert {again.routes.decision(p)[0]
          for p in jcg.backends.problems_of(step, x, w1, w2)} == {"pipelined_ce"}
  # Fewer plans: another key, measured anew.
  other = jcg.autotune_step(mesh, "tp", step, x, w1, w2, seconds_per_problem=1e-5,
                            implementations=("ring",))
  assert other.plan == "xla" and len(compiled) == 1 and len(timed) == 1
  with pytest.raises(ValueError, match="implementations has 'nccl'"):  # before any work
    jcg.autotune_step(mesh, "tp", None, implementations=("nccl",))


def test_a_cached_step_plan_that_is_no_plan_is_measured_anew(fake, monkeypatch, tmp_path):
  """A cache entry whose plan is not among the step's plans (a file edited by
  hand, or by another version) is not taken: the step is measured again."""
  path = tmp_path / "autotune.json"
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", str(path))
  mesh, step, (x, w1, w2) = _connected_mlp_step()
  monkeypatch.setattr(tuning, "decide", lambda times: ("cublasmp_split_p2p", "fake"))
  monkeypatch.setattr(tuning, "time_candidates", lambda runs, rounds, **_: (
      {n: (1e-3 if n == "pipelined_ce" else 2e-3) for n in runs}))
  assert jcg.autotune_step(mesh, "tp", step, x, w1, w2,
                           seconds_per_problem=1e-5).plan == "pipelined_ce"
  cache = tuning.load_cache(str(path))
  for section in cache.values():
    for key, entry in section.items():
      if key.startswith("autotune_step"):
        entry[0] = "a_plan_no_more"
  tuning.save_cache(str(path), cache)
  measured = []
  monkeypatch.setattr(tuning, "_measure", lambda *a: measured.append(a) or ("xla", "?"))
  assert jcg.autotune_step(mesh, "tp", step, x, w1, w2, seconds_per_problem=1e-5).plan == "xla"
  assert len(measured) == 1


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_a_step_traced_before_tuning_runs_the_tuned_route_and_nothing_else_recompiles(
    fake, monkeypatch):
  """The step jitted and run before autotune_step keeps its route under the
  process's plan; the tuned step runs it under the tuned one (here every op
  on the ring), and an unrelated jitted function is not traced again."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  mesh, step, args = _connected_mlp_step()
  jitted = jax.jit(step)
  traces = []

  @jax.jit
  def unrelated(v):
    traces.append(1)
    return v * 2

  reference = jitted(*args)
  unrelated(jnp.ones(3))
  assert "ppermute" not in str(jax.make_jaxpr(jitted)(*args))
  monkeypatch.setattr(tuning, "decide", lambda times: ("cublasmp_split_p2p", "fake"))
  monkeypatch.setattr(tuning, "time_candidates", lambda runs, rounds, **_: (
      {n: (1e-3 if n == "ring" else 2e-3) for n in runs}))
  tuned = jcg.autotune_step(mesh, "tp", jitted, *args, seconds_per_problem=1e-5)
  assert tuned.plan == "ring"
  assert "ppermute" in str(jax.make_jaxpr(tuned)(*args))
  assert "ppermute" not in str(jax.make_jaxpr(jitted)(*args))  # the process's plan is as it was
  for got, want in zip(tuned(*args), reference):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  unrelated(jnp.ones(3))
  assert len(traces) == 1


def test_step_plans_time_a_uniform_per_op_choice_once():
  ag = Problem(AG, 8, 8, 16, "bfloat16", False, 2)
  rs = Problem(RS, 8, 16, 8, "bfloat16", False, 2)
  plan = REGISTRY.plan()
  mixed = tuning.step_plans([ag, rs], {ag: ("pallas_mgpu", "m"), rs: ("xla", "m")}, plan=plan)
  assert list(mixed)[0] == "tuned" and mixed["tuned"][ag] == ("pallas_mgpu", "m")
  assert "pallas_mgpu" not in mixed  # it has no ReduceScatter
  uniform = tuning.step_plans([ag, rs], {ag: ("ring", "m"), rs: ("ring", "m")}, plan=plan)
  assert "tuned" not in uniform and uniform["ring"][rs][0] == "ring"
  only_ag = tuning.step_plans([ag], {ag: ("ring", "m")}, plan=plan)
  assert "tuned" not in only_ag and "ring" in only_ag
  assert "pallas_mgpu" not in only_ag  # it cannot run this shape
  # implementations= limits the plans of one implementation; XLA stays.
  few = tuning.step_plans([ag, rs], {ag: ("ring", "m"), rs: ("xla", "m")},
                               implementations=("pipelined_ce",), plan=plan)
  assert list(few) == ["tuned", "pipelined_ce", "xla"]
  with pytest.raises(ValueError, match="implementations has 'fast'; allowed: cublasmp_default"):
    tuning.step_plans([ag], {ag: ("xla", "m")}, implementations=("fast",), plan=plan)


def test_step_decision_fastest_plan_by_the_slowest_process():
  decide = tuning.decide_step
  assert decide({"tuned": [1.0, 1.2], "xla": [1.1, 1.1]})[0] == "xla"  # slowest process rules
  # A lead under the margin over XLA is noise: XLA takes it.
  margin = tuning.KEEP_MARGIN
  assert decide({"tuned": [1 - margin / 2], "xla": [1.0]})[0] == "xla"
  assert decide({"tuned": [1 - margin * 1.5], "xla": [1.0]})[0] == "tuned"
  plan, why = decide({"tuned": [0.97e-3], "pipelined_ce": [0.95e-3], "xla": [1e-3],
                      "ring": [float("inf")]})
  assert plan == "pipelined_ce"
  assert why.startswith("step measured: all pipelined_ce 0.950 ms, per-op choices 0.970 ms")
  assert "ring failed" in why and "(all pipelined_ce kept)" in why
  # A plan that beats XLA by the margin but ties another: the names order it.
  assert decide({"cublasmp_default": [0.9], "ring": [0.9], "xla": [1.0]})[0] == "cublasmp_default"


@pytest.mark.parametrize("on_abort, watching", [("exit", True), ("wait", False)])
def test_connect_starts_the_sentinel_unless_told_to_wait(fake, monkeypatch, on_abort,
                                                          watching):
  monkeypatch.setenv(settings.ON_ABORT, on_abort)
  jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",)), "tp")
  assert (REGISTRY._sentinel is not None) == watching
  if REGISTRY._sentinel is not None:
    REGISTRY._sentinel.stop()


def test_call_counters_sum_the_contexts_and_subtract_to_a_span(fake, monkeypatch):
  """REGISTRY.call_counters: the contexts' calls and host time summed; two reads
  subtract to the span between them (the benchmark and the example's A/B report
  the host time of a fused call that way)."""
  assert REGISTRY.call_counters().calls == 0 and REGISTRY.call_counters().host_us_per_call() is None
  rows = [{"calls": 10, "host_seconds": 0.001}, {"calls": 10, "host_seconds": 0.002}]
  monkeypatch.setattr(fake, "contexts", lambda: rows)
  before = REGISTRY.call_counters()
  assert (before.calls, before.contexts) == (20, 2)
  rows[0] = {"calls": 14, "host_seconds": 0.0014}
  rows[1] = {"calls": 14, "host_seconds": 0.0026}
  span = REGISTRY.call_counters() - before
  assert span.calls == 8 and span.contexts == 2
  assert span.host_us_per_call() == pytest.approx(125.0)
  assert (span + span).calls == 16
