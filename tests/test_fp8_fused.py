"""The extension's fused FP8 ops (``collectives=`` a ``CublasMpBackend`` bound to
the plan, or
``CommGemmConfig(backend="cublasmp", fp8=...)``), on CPU with a stand-in for
the extension: lowered for the GPU they are the FP8 custom calls, with FP8
operands and the gathered FP8 operand reused where the self-test's verdict
allows; lowered for the CPU (their fallback) they compute what XLA's
collectives compute; and what they cannot run is refused by name. The
handlers themselves run in tests/gpu (one GPU: tp = 1; the suite: two)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.backends.routes as routes
import fp8_mlp
from conftest import cpu_mesh, stand_in_plan
from fake_native import install_fake_native
from jax_comm_gemm.backends import CublasMpBackend
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from jax_comm_gemm.runtime.constants import TARGETS
from jax_comm_gemm.runtime.registry import REGISTRY

AG, RS = TARGETS["fp8_all_gather_matmul"], TARGETS["fp8_matmul_reduce_scatter"]


def _connected(monkeypatch, mesh, passing=lambda key: True):
  install_fake_native(monkeypatch, passing)
  assert jcg.connect(mesh, "tp").ok


def _fused(*algorithms):
  """The fused ops of `algorithms`, bound to the plan in force (connect's)."""
  return routes.bound(CublasMpBackend(*algorithms), REGISTRY.plan())


def _gpu_text(mesh, recipe, collectives, keep=False, seed=0):
  return fp8_mlp.step(mesh, recipe, collectives, keep).trace(*fp8_mlp.inputs(seed)).lower(
      lowering_platforms=("cuda",)).as_text()


def _calls(text, target):
  return len(re.findall(rf'custom_call @{target}\b', text))


@pytest.mark.parametrize("all_gather, reduce_scatter",
                         [("split_p2p", "split_p2p"), ("pipelined_ce", "xla"),
                          ("default", "ring")])
@pytest.mark.parametrize("keep", [False, True])
def test_fused_fp8_computes_what_xla_computes(monkeypatch, all_gather, reduce_scatter, keep):
  """Lowered for the CPU the fused ops are XLA's collectives and the same FP8
  GEMMs: loss and every gradient as with collectives="xla", on fresh inputs,
  delayed scaling included (the scales are the ops' operands)."""
  mesh = cpu_mesh(2)
  _connected(monkeypatch, mesh)
  fused = _fused(all_gather, reduce_scatter)
  args = fp8_mlp.inputs(seed=len(all_gather) + keep)
  got = fp8_mlp.step(mesh, Fp8Recipe(), fused, keep)(*args)
  want = fp8_mlp.step(mesh, Fp8Recipe(), "xla", keep)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) < 1e-6


@pytest.mark.parametrize("keep, standalone", [(False, 1), (True, 0)])
def test_fused_fp8_lowers_to_the_fp8_custom_calls_and_reuses(monkeypatch, keep, standalone):
  """For the GPU: two FP8 AllGather+GEMMs (fc1's forward, fc2's dgrad) and two
  FP8 GEMM+ReduceScatters (fc2's forward, fc1's dgrad), FP8 operands with f32
  scalar scales, w in the TN form; fc2's weight gradient reads the gathered
  E5M2 grad_output, so the only all-gather is fc1's backward re-gather (none
  with keep_gathered_input)."""
  mesh = cpu_mesh(2)
  _connected(monkeypatch, mesh)
  text = _gpu_text(mesh, Fp8Recipe(), _fused("split_p2p", "split_p2p"), keep)
  assert (_calls(text, AG), _calls(text, RS)) == (2, 2)
  assert len(re.findall(r"stablehlo\.all_gather", text)) == standalone
  # fc1's forward gathers E4M3 x, fc2's dgrad E5M2 dy, each against an E4M3
  # weight copy [features, k] with two f32 scalar scales; fc2's hands out the
  # gathered E5M2 bytes, fc1's only when kept.
  signatures = sorted((args, results.strip("()")) for args, results in re.findall(
      rf"custom_call @{AG}\(.*transpose_w = true.*\}} : \((.*)\) -> (.*)", text))
  gathered = (", tensor<64x48xf8E4M3FN>",) if keep else ("",)
  assert signatures == [
      ("tensor<32x48xf8E4M3FN>, tensor<16x48xf8E4M3FN>, tensor<f32>, tensor<f32>",
       f"tensor<64x16xf32>{gathered[0]}"),
      ("tensor<32x48xf8E5M2>, tensor<16x48xf8E4M3FN>, tensor<f32>, tensor<f32>",
       "tensor<64x16xf32>, tensor<64x48xf8E5M2>")], signatures


@pytest.mark.filterwarnings("ignore:.*layout self-test failed:RuntimeWarning")  # on purpose
def test_a_failing_verdict_gathers_again(monkeypatch):
  """Where the self-test did not verify the gathered E5M2 operand, fc2's
  weight gradient all-gathers dy again, and the report says why."""
  mesh = cpu_mesh(2)
  _connected(monkeypatch, mesh, passing=lambda key: key.dtype != "float8_e5m2")
  text = _gpu_text(mesh, Fp8Recipe(), _fused("split_p2p", "split_p2p"), keep=True)
  assert len(re.findall(r"stablehlo\.all_gather", text)) == 1
  config = jcg.CommGemmConfig(backend="cublasmp", fp8=Fp8Recipe())
  fc2 = report.layer_path(config, mesh, "tp", jnp.bfloat16, reduce_scatter_layer=True)
  assert fc2.path == report.FUSED_WITH_ALL_GATHER and "fake self-test" in fc2.reason
  fc1 = report.layer_path(config, mesh, "tp", jnp.bfloat16, keep_gathered_input=True)
  assert fc1.path == report.FUSED_WITH_REUSE and "fused FP8 ops (split_p2p" in fc1.reason


def test_the_config_routes_fp8_to_the_fused_ops(monkeypatch):
  """CommGemmConfig(backend="cublasmp", fp8=...) runs the layers' FP8 on the
  fused ops, with the config's algorithms; reduce_scatter="xla" keeps XLA's
  FP8 reduce-scatter."""
  mesh = cpu_mesh(2)
  _connected(monkeypatch, mesh)
  x, w1, _ = fp8_mlp.inputs()
  for reduce_scatter, rs_calls in (("pipelined_ce", 1), ("xla", 0)):
    config = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="default",
                                reduce_scatter=reduce_scatter, fp8=Fp8Recipe())
    f = jax.shard_map(lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config),
                      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    loss = lambda x, w: jnp.sum(f(x, w) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w1).lower(
        lowering_platforms=("cuda",)).as_text()
    assert (_calls(text, AG), _calls(text, RS)) == (1, rs_calls)
    assert "algorithm = 0" in text  # "default"


def test_what_the_fused_fp8_ops_cannot_run_is_refused():
  mesh = cpu_mesh(2)
  x, w1, _ = fp8_mlp.inputs()
  fused = CublasMpBackend()
  def lowered(recipe, w):
    f = jax.shard_map(
        lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=recipe, collectives=fused),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    return jax.eval_shape(f, x, w)
  with pytest.raises(ValueError, match=r"one scale per tensor.*'row' scaling runs on "
                                       r"collectives 'xla' or 'ring'"):
    lowered(Fp8Recipe("row"), w1)
  with pytest.raises(ValueError, match=r"multiples of 16.*got w \(48, 12\)"):
    lowered(Fp8Recipe(), w1[:, :24])
  with pytest.raises(ValueError, match=r"`collectives` must be one of \('xla', 'ring'\) "
                                       r"or a jax_comm_gemm.backends.CublasMpBackend"):
    jax.eval_shape(jax.shard_map(
        lambda x, w: fp8_all_gather_matmul(x, w, "tp", collectives="cublasmp"), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")), x, w1)
  with pytest.raises(ValueError, match=r"backend 'cublasmp' runs FP8 with one scale per "
                                       r"tensor"):
    jcg.CommGemmConfig(backend="cublasmp", fp8=Fp8Recipe("row"))


class _LooksFused:
  """Has the fused FP8 ops' names, but is no backend that declares them."""

  def fp8_all_gather_matmul(self, *args, **kwargs):
    raise AssertionError("called")

  fp8_matmul_reduce_scatter = fp8_all_gather_matmul


@pytest.mark.parametrize("collectives", [_LooksFused(), jcg.backends.XlaBackend(),
                                         jcg.backends.AutoBackend()],
                         ids=lambda c: type(c).__name__)
def test_the_fused_fp8_ops_are_found_through_the_backend_interface(collectives):
  """`collectives` runs the fused FP8 ops where the Backend declares them
  (Backend.fp8_fused_ops), not wherever a method of that name exists."""
  mesh = cpu_mesh(2)
  x, w1, _ = fp8_mlp.inputs()
  f = jax.shard_map(lambda x, w: fp8_all_gather_matmul(x, w, "tp", collectives=collectives),
                    mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  with pytest.raises(ValueError, match=r"`collectives` must be one of"):
    jax.eval_shape(f, x, w1)
  assert CublasMpBackend.fp8_fused_ops and not jcg.backends.Backend.fp8_fused_ops


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_auto_runs_an_fp8_problem_on_the_fused_op_it_measured(monkeypatch):
  """backend="auto": a decision naming a fused algorithm routes the FP8
  problem to it (keyed with the recipe); a "row" recipe, which the fused ops
  cannot run, stays on XLA's collectives even when the environment forces it."""
  mesh = cpu_mesh(2)
  _connected(monkeypatch, mesh)
  x, w1, _ = fp8_mlp.inputs()
  config = jcg.CommGemmConfig(fp8=Fp8Recipe())

  def lowered(config):
    f = jax.shard_map(lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config),
                      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    return jax.jit(f).trace(x, w1).lower(lowering_platforms=("cuda",)).as_text()

  assert _calls(lowered(config), AG) == 0  # not measured: XLA's collectives
  f = jax.shard_map(lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config),
                    mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  mine = [p for p in jcg.backends.problems_of(f, x, w1) if p.fp8 and p.op == routes.AG]
  assert mine
  plan = REGISTRY.plan()
  REGISTRY.publish(plan.with_decisions({p: ("pipelined_ce", "measured") for p in mine}))
  text = lowered(config)
  assert _calls(text, AG) == 1 and "algorithm = 101" in text
  row = dataclasses.replace(config, fp8=Fp8Recipe("row"))
  REGISTRY.publish(dataclasses.replace(plan, settings=stand_in_plan(
      autotune="pipelined_ce").settings))
  assert _calls(lowered(row), AG) == 0
