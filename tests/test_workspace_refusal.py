"""Where cuBLASMp cannot get its workspace (NCCL has no symmetric memory: ranks
sharing a GPU, GPUs without peer access), the fused path steps aside.

The stand-in extension's contexts refuse the workspace as cuBLASMp 0.10 does
there. ``connect`` learns it once, agreed by every process; ``auto`` then
never takes cuBLASMp's algorithms (nor jax's Pallas kernel), the layers keep
reuse where the project's own algorithms verified it, the report and
``cublasmp_status()`` say why, and ``backend="cublasmp"`` on one of cuBLASMp's
algorithms is an error at ``connect`` and at trace time that names the reason.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.backends.routes as routes
import jax_comm_gemm.backends.tuning as tuning
import jax_comm_gemm.runtime.communicators as connect_module
from fake_native import fake_probe, install_fake_native
from fused_emulation import check_against_reference, random_inputs
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime import REGISTRY, capability, settings
from jax_comm_gemm.runtime.capability import VerdictKey, WorkspaceKey
from jax_comm_gemm.runtime.constants import TARGETS

REFUSAL = "cublasMpMalloc failed: the requested functionality is not supported"
BIG = routes.Problem(routes.AG, 8192, 8192, 8192, "bfloat16", False, 2)  # fused by rule of thumb


def mesh2():
  return Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))


@pytest.fixture
def refused(monkeypatch):
  """A stand-in extension whose contexts are refused cuBLASMp's workspace;
  the self-test's probes pass, and `ran` lists the algorithms they ran."""
  native = install_fake_native(monkeypatch, workspace_error=REFUSAL)
  native.ran = []
  monkeypatch.setattr(capability, "_probe", fake_probe(ran=native.ran,
                                                      workspace_error=REFUSAL))
  return native


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a refused case is no failed self-test
def test_connect_learns_the_refusal_once_and_the_self_test_runs_what_can_run(refused):
  status = jcg.connect(mesh2(), "tp")
  assert status.ok and REFUSAL in status.reason  # the own algorithms still run
  assert refused.ran == ["pipelined_ce"]
  plan = REGISTRY.plan()
  assert not plan.verdict(WorkspaceKey(2)).ok and REFUSAL in plan.verdict(WorkspaceKey(2)).reason
  for algorithm in ("default", "split_p2p"):
    verdict = plan.verdict(VerdictKey(2, algorithm, "bfloat16", True, plan.layout))
    assert not verdict.ok and REFUSAL in verdict.reason
  assert plan.verdict(VerdictKey(2, "pipelined_ce", "bfloat16", True, plan.layout)).ok
  assert plan.verdict(WorkspaceKey(4)).ok  # no group of 4 was probed
  status = jcg.cublasmp_status()
  assert status.ok and REFUSAL in status.reason and "groups of 2" in status.reason


def test_one_refusing_process_makes_every_process_refuse(monkeypatch):
  """The processes exchange what their contexts found: a refusal in another
  process is this one's too, so every rank routes alike."""
  install_fake_native(monkeypatch)
  exchanged = []

  def all_gather(*parts, value, timeout_s, processes):
    exchanged.append(parts)
    # each process's contexts: (refusal, whether it took a plain workspace)
    return [value, [[REFUSAL, False]]] if "workspace" in parts else [value]

  monkeypatch.setattr(connect_module.kv, "all_gather", all_gather)
  jcg.connect(mesh2(), "tp")
  assert any("workspace" in parts for parts in exchanged)
  assert REFUSAL in REGISTRY.plan().verdict(WorkspaceKey(2)).reason


def test_one_refusing_context_of_the_axis_refuses_the_axis(monkeypatch):
  """In one process with several groups, one context's refusal refuses the axis."""
  native = install_fake_native(monkeypatch)
  full = native.contexts
  monkeypatch.setattr(native, "contexts", lambda: [
      {**c, "workspace_error": REFUSAL if i == 1 else ""} for i, c in enumerate(full())])
  mesh = Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))
  jcg.connect(mesh, "tp")
  assert not REGISTRY.plan().verdict(WorkspaceKey(2)).ok


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_auto_never_chooses_cublasmp_or_pallas_where_refused(refused, monkeypatch):
  jcg.connect(mesh2(), "tp")
  runs = [name for name in routes.candidates(BIG) if routes.runnable(name, BIG, REGISTRY.plan()).ok]
  assert runs == ["xla", "ring", "pipelined_ce"]  # what autotune measures
  assert REFUSAL in routes.runnable("cublasmp_split_p2p", BIG, REGISTRY.plan()).reason
  assert "Pallas kernel needs NCCL symmetric memory" in routes.runnable("pallas_mgpu", BIG, REGISTRY.plan()).reason
  # The rule of thumb's fused default, and a choice cached from elsewhere.
  name, why = routes.choose(BIG, "cublasmp_split_p2p", REGISTRY.plan())
  assert name == "xla" and REFUSAL in why
  plan = REGISTRY.plan().with_decisions({BIG: ("cublasmp_default", "measured elsewhere")})
  name, why = routes.choose(BIG, "cublasmp_split_p2p", plan)
  assert name == "xla" and why.startswith("measured elsewhere") and REFUSAL in why
  assert routes.choose(BIG, "pipelined_ce", REGISTRY.plan())[0] == "pipelined_ce"  # the own algorithms run
  for forced in ("cublasmp_split_p2p", "pallas_mgpu"):
    name, why = routes.choose(BIG, "pipelined_ce", _forced(forced))
    assert name == "xla" and why.startswith(f"forced by JAX_COMM_GEMM_AUTOTUNE={forced}")
    assert REFUSAL in why


def test_autotune_step_times_no_plan_of_what_cannot_run_here(refused):
  jcg.connect(mesh2(), "tp")
  rs = routes.Problem(routes.RS, 8192, 8192, 8192, "bfloat16", False, 2)
  plans = tuning.step_plans([BIG, rs], {BIG: ("pipelined_ce", "m"), rs: ("xla", "m")},
                             plan=REGISTRY.plan())
  assert sorted(plans) == ["pipelined_ce", "ring", "tuned", "xla"]


def _forced(implementation):
  """The plan in force with JAX_COMM_GEMM_AUTOTUNE=`implementation`."""
  plan = REGISTRY.plan()
  return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings,
                                                                autotune=implementation))


def test_the_report_says_why(refused):
  mesh = mesh2()
  jcg.connect(mesh, "tp")
  config = jcg.CommGemmConfig()
  row = report.layer_path(config, mesh, "tp", jnp.bfloat16, reduce_scatter_layer=True)
  assert row.path == report.FUSED_WITH_REUSE and REFUSAL in row.reason
  assert "project's own algorithms" in row.reason
  column = report.layer_path(config, mesh, "tp", jnp.bfloat16)
  assert column.path == report.FUSED_WITH_ALL_GATHER and REFUSAL in column.reason
  assert REFUSAL in jcg.backends.choose_backend(config, "tp", mesh).reason
  counts = report.expected_all_gathers(config, mesh, "tp", jnp.bfloat16)
  assert (counts.standalone_all_gathers, counts.fused_all_gather_matmuls) == (1, 2)


@pytest.mark.parametrize("algorithms", [dict(), dict(all_gather_algorithm="default"),
                                        dict(all_gather_algorithm="pipelined_ce",
                                             reduce_scatter="split_p2p")])
def test_backend_cublasmp_on_cublasmps_algorithms_fails_at_connect(refused, algorithms):
  """An error that names the refusal and what runs instead; the axis stays
  connected for the own algorithms, and a config of them proceeds."""
  mesh = mesh2()
  config = jcg.CommGemmConfig(backend="cublasmp", **algorithms)
  with pytest.raises(RuntimeError, match=r"connect\('tp'\): backend='cublasmp' with .*"
                     + REFUSAL + r".*all_gather_algorithm='pipelined_ce'"):
    jcg.connect(mesh, "tp", config=config)
  assert REGISTRY.comm_id(mesh, "tp") is not None
  with pytest.raises(RuntimeError, match=REFUSAL):  # and again at trace time
    jax.eval_shape(_program(mesh, config), *_args(0))
  own = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="pipelined_ce")
  assert jcg.connect(mesh, "tp", config=own).ok
  assert jcg.connect(mesh, "tp", config=jcg.CommGemmConfig()).ok  # auto steps aside


def test_a_forced_cublasmp_backend_fails_at_connect(refused, monkeypatch):
  """JAX_COMM_GEMM_BACKEND=cublasmp turns an auto config into one that must fuse."""
  monkeypatch.setenv(settings.BACKEND, "cublasmp")
  with pytest.raises(RuntimeError, match=f"JAX_COMM_GEMM_BACKEND=cublasmp with "
                     f"all_gather_algorithm='split_p2p': .*{REFUSAL}"):
    jcg.connect(mesh2(), "tp", config=jcg.CommGemmConfig())


def test_fp8_on_backend_cublasmp_fails_at_trace_time(refused):
  mesh = mesh2()
  jcg.connect(mesh, "tp")
  config = jcg.CommGemmConfig(backend="cublasmp", fp8=Fp8Recipe())
  with pytest.raises(RuntimeError, match=r"backend='cublasmp' \(FP8\) with .*" + REFUSAL):
    jax.eval_shape(_program(mesh, config), *_args(0))


def _program(mesh, config):
  def local(x, w1, w2):
    return jcg.mlp(x, w1, w2, axis_name="tp", config=config)

  return jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                       out_specs=P("tp"))


def _args(seed):
  return random_inputs(seed, [(32, 16), (16, 32), (32, 16)], jnp.float32)


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (list, tuple)) else [value]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


@pytest.mark.filterwarnings("ignore:.*layout self-test failed:RuntimeWarning")  # on purpose
@pytest.mark.parametrize("backend", ["cublasmp", "auto"])
@pytest.mark.parametrize("verified", [True, False], ids=["verdict_passes", "verdict_fails"])
def test_pipelined_ce_runs_and_reuses_where_its_verdict_passed(monkeypatch, backend, verified):
  """The MLP on pipelined_ce (configured, or auto's measured choice) on a
  refused group: right numbers, fc2's backward hands its gathered grad_output
  to the weight gradient where pipelined_ce's self-test passed (one
  lax.all_gather left, fc1's), and gathers again where it failed."""
  native = install_fake_native(monkeypatch, workspace_error=REFUSAL)
  monkeypatch.setattr(capability, "_probe", fake_probe(
      passing=lambda key: verified or key.algorithm != "pipelined_ce", workspace_error=REFUSAL))
  mesh = mesh2()
  config = jcg.CommGemmConfig(backend=backend, all_gather_algorithm="pipelined_ce",
                              reduce_scatter="pipelined_ce")
  jcg.connect(mesh, "tp")
  assert native.connected
  if backend == "auto":  # as if every problem measured fastest on pipelined_ce
    REGISTRY.publish(_forced("pipelined_ce"))
  args = _args(7)
  program = _program(mesh, config)
  check_against_reference(lambda *a: (program(*a),),
                          lambda x, w1, w2: (jax.nn.gelu(x @ w1) @ w2,), args, [(32, 16)],
                          jnp.float32, seed=8, arg_names=["x", "fc1", "fc2"])
  grad = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(program(*a) ** 2), (0, 1, 2)))(*args)
  equations = list(_equations(grad.jaxpr))
  calls = [e for e in equations if e.primitive.name == TARGETS["all_gather_matmul"]]
  assert calls and all(c.params["algorithm"] == jcg.config.ALGORITHMS["pipelined_ce"]
                       for c in calls)
  dgrad = [c for c in calls if c.params["transpose_w"]]
  assert [c.params["return_gathered"] for c in dgrad] == [verified]
  gathers = [e for e in equations if e.primitive.name == "all_gather"]
  assert len(gathers) == (1 if verified else 2)


def test_a_failed_layout_self_test_says_so_once(monkeypatch):
  """Cases whose self-test fails turn reuse off there (the layers stay correct)
  and connect says so in one warning naming the failures; where every case
  passes it says nothing."""
  install_fake_native(monkeypatch, passing=lambda key: key.dtype != "float32")
  with pytest.warns(RuntimeWarning, match=r"the layout self-test failed.*fake self-test") as seen:
    jcg.connect(mesh2(), "tp")
  assert sum("self-test failed" in str(w.message) for w in seen) == 1
  install_fake_native(monkeypatch)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jcg.connect(mesh2(), "tp")
