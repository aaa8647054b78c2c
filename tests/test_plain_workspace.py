"""Where NCCL has no symmetric memory (ranks sharing a GPU, GPUs without peer
access, tensor parallelism across hosts), the extension gives cuBLASMp a plain
workspace: its default runs there, without overlap; split_p2p and jax's Pallas
kernel do not.

The stand-in extension's contexts report what the real one does there: the
refusal of cublasMpMalloc and workspace_mode "plain". ``connect``'s verdict
names the mode, the self-test runs cuBLASMp's default, ``auto`` and autotune
take it as a candidate, the gathered operand is reused where its verdict
passed (bf16 and FP8), the report says which mode runs, and split_p2p is
refused with the reason at ``connect`` and at trace time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.backends.routes as routes
import jax_comm_gemm.backends.tuning as tuning
from fake_native import fake_probe, install_fake_native
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime import REGISTRY, capability
from jax_comm_gemm.runtime.capability import PLAIN_WORKSPACE, VerdictKey, WorkspaceKey
from jax_comm_gemm.runtime.constants import TARGETS

REFUSAL = "cublasMpMalloc failed: the requested functionality is not supported"
BIG = routes.Problem(routes.AG, 8192, 8192, 8192, "bfloat16", False, 2)


def mesh2():
  return Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))


@pytest.fixture
def plain(monkeypatch):
  """A stand-in extension whose contexts took a plain workspace; the
  self-test's probes pass, and `ran` lists the algorithms they ran."""
  native = install_fake_native(monkeypatch, workspace_error=REFUSAL, workspace_mode="plain")
  native.ran = []
  monkeypatch.setattr(capability, "_probe", fake_probe(ran=native.ran))
  return native


def test_connect_names_the_mode_and_the_self_test_runs_cublasmps_default(plain):
  status = jcg.connect(mesh2(), "tp")
  assert status.ok and PLAIN_WORKSPACE in status.reason and REFUSAL in status.reason
  assert plain.ran == ["default", "pipelined_ce"]  # split_p2p cannot run there
  plan = REGISTRY.plan()
  workspace = plan.verdict(WorkspaceKey(2))
  assert workspace.ok and workspace.plain and not capability.symmetric_memory(workspace)
  for dtype in ("bfloat16", "float8_e4m3fn"):
    assert plan.verdict(VerdictKey(2, "default", dtype, True, plan.layout)).ok
    split = plan.verdict(VerdictKey(2, "split_p2p", dtype, True, plan.layout))
    assert not split.ok and "cuBLASMp refuses 'split_p2p' on a plain workspace" in split.reason
  assert PLAIN_WORKSPACE in jcg.cublasmp_status().reason


def test_a_mix_of_plain_and_symmetric_contexts_is_refused(monkeypatch):
  """Only every context plain makes the mode: a group whose ranks got unlike
  workspaces would run cuBLASMp's collectives on unlike memory."""
  native = install_fake_native(monkeypatch, workspace_mode="plain")
  full = native.contexts
  monkeypatch.setattr(native, "contexts", lambda: [
      {**c, "workspace_error": REFUSAL if i == 1 else "",
       "workspace_mode": "plain" if i == 1 else "symmetric"} for i, c in enumerate(full())])
  jcg.connect(Mesh(np.asarray(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp")), "tp")
  assert not REGISTRY.plan().verdict(WorkspaceKey(2)).ok


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_auto_and_autotune_take_cublasmps_default_as_a_candidate(plain):
  jcg.connect(mesh2(), "tp")
  runs = [name for name in routes.candidates(BIG) if routes.runnable(name, BIG, REGISTRY.plan()).ok]
  assert runs == ["xla", "ring", "cublasmp_default", "pipelined_ce"]
  assert "on a plain workspace" in routes.runnable("cublasmp_split_p2p", BIG, REGISTRY.plan()).reason
  assert "Pallas kernel needs NCCL symmetric memory" in routes.runnable("pallas_mgpu", BIG, REGISTRY.plan()).reason
  plan = REGISTRY.plan().with_decisions({BIG: ("cublasmp_default", "measured")})
  assert routes.choose(BIG, "cublasmp_split_p2p", plan)[0] == "cublasmp_default"
  name, why = routes.choose(BIG, "cublasmp_split_p2p", REGISTRY.plan())  # the rule of thumb's
  assert name == "xla" and "on a plain workspace" in why
  fp8 = routes.Problem(routes.AG, 8192, 8192, 8192, "bfloat16", True, 2, fp8=Fp8Recipe().key)
  assert routes.runnable("cublasmp_default", fp8, REGISTRY.plan()).ok
  rs = routes.Problem(routes.RS, 8192, 8192, 8192, "bfloat16", False, 2)
  plans = tuning.step_plans([BIG, rs], {BIG: ("cublasmp_default", "m"), rs: ("xla", "m")},
                             plan=REGISTRY.plan())
  assert sorted(plans) == ["cublasmp_default", "pipelined_ce", "ring", "tuned", "xla"]
  # Timed as a group without symmetric memory: calls cost the network's time.
  assert tuning.iterations(BIG, 1.0, capability.symmetric_memory(routes.workspace(2, REGISTRY.plan()))) \
      < tuning.iterations(BIG, 1.0, True)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_the_report_names_the_mode_and_the_weight_gradient_reuses(plain, dtype):
  mesh = mesh2()
  jcg.connect(mesh, "tp")
  fp8 = Fp8Recipe() if dtype == "fp8" else None
  config = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="default", fp8=fp8)
  row = report.layer_path(config, mesh, "tp", jnp.bfloat16, reduce_scatter_layer=True)
  assert row.path == report.FUSED_WITH_REUSE, row
  assert f"plain workspace ({PLAIN_WORKSPACE})" in row.reason
  counts = report.expected_all_gathers(config, mesh, "tp", jnp.bfloat16)
  assert (counts.standalone_all_gathers, counts.fused_all_gather_matmuls) == (1, 2)
  symmetric = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="pipelined_ce",
                                 reduce_scatter="pipelined_ce", fp8=fp8)
  own = report.layer_path(symmetric, mesh, "tp", jnp.bfloat16, reduce_scatter_layer=True)
  assert "plain workspace" not in own.reason  # the own algorithms have no cuBLASMp workspace


def _program(mesh, config):
  return jax.shard_map(lambda x, w1, w2: jcg.mlp(x, w1, w2, axis_name="tp", config=config),
                       mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                       out_specs=P("tp"))


def _args():
  return [jnp.ones((32, 16), jnp.float32), jnp.ones((16, 32), jnp.float32),
          jnp.ones((32, 16), jnp.float32)]


def test_split_p2p_is_refused_with_the_reason_and_default_traces(plain):
  mesh = mesh2()
  split = jcg.CommGemmConfig(backend="cublasmp")  # split_p2p, the configured default
  with pytest.raises(RuntimeError, match=r"all_gather_algorithm='split_p2p': cuBLASMp refuses "
                     r"'split_p2p' on a plain workspace .*all_gather_algorithm='default'"):
    jcg.connect(mesh, "tp", config=split)
  with pytest.raises(RuntimeError, match="on a plain workspace"):  # and at trace time
    jax.eval_shape(_program(mesh, split), *_args())
  default = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="default",
                               reduce_scatter="default")
  assert jcg.connect(mesh, "tp", config=default).ok
  grad = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(_program(mesh, default)(*a) ** 2),
                                 (0, 1, 2)))(*_args())
  text = str(grad)
  assert TARGETS["all_gather_matmul"] in text and TARGETS["matmul_reduce_scatter"] in text
