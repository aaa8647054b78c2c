"""FP8 on the ring (jax_comm_gemm/ring.py), on CPU: the ring computes what
XLA's collectives compute, moves FP8 bytes by ppermute, keeps the reuse, and
``backend="auto"`` runs an FP8 problem where its decision (keyed by the
recipe) says."""

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
from jax_comm_gemm.diagnostics import hlo, report
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from jax_comm_gemm.runtime.registry import REGISTRY
from tolerance import assert_reduction_close



@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("keep", [False, True])
def test_the_ring_computes_what_xla_computes(size, scaling, keep):
  """Same FP8 operands and GEMMs per shard: equal up to the order of the sums
  (float32 here), on fresh inputs, loss and every gradient."""
  mesh, recipe = cpu_mesh(size), Fp8Recipe(scaling=scaling)
  args = fp8_mlp.inputs(seed=size + 10 * keep)
  ring = fp8_mlp.step(mesh, recipe, "ring", keep)(*args)
  xla = fp8_mlp.step(mesh, recipe, "xla", keep)(*args)
  for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(xla)):
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 1e-5, err


def test_the_ring_moves_fp8_bytes_by_ppermute():
  """Each fused step's shards travel as FP8 (E4M3 x forward, E5M2 dy
  backward) through collective-permutes; per-row scales go with their rows."""
  mesh = cpu_mesh(4)
  for scaling in ("tensor", "row"):
    program = fp8_mlp.step(mesh, Fp8Recipe(scaling=scaling), "ring")
    text = program.lower(*fp8_mlp.inputs()).as_text()
    permutes = re.findall(r"collective_permute[^\n]*", text)
    assert any("f8E4M3FN" in line for line in permutes), scaling
    assert any("f8E5M2" in line for line in permutes), scaling
    # Per-row scales ([N/4] float32) travel beside their rows; one scale per
    # tensor (agreed by pmax) does not travel.
    scales = [line for line in permutes if "tensor<16xf32>" in line]
    assert bool(scales) == (scaling == "row"), scaling


def test_the_mlp_on_the_ring_keeps_the_reuse():
  """backend="ring" with FP8: the per-layer report says so, and the compiled
  step has the counts it expects: fc1's backward gathers again (1), or keeps
  its forward's (0); fc2's weight gradient reuses the ring's gathered dy."""
  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(backend="ring", fp8=Fp8Recipe())
  path = report.layer_path(config, mesh, "tp", jnp.float32, reduce_scatter_layer=True)
  assert path.path == report.FP8_ON_RING and "on the ring" in path.reason
  x, a, b = fp8_mlp.inputs()
  for keep in (False, True):
    expected = report.expected_all_gathers(config, mesh, "tp", jnp.float32,
                                           keep_gathered_input=keep)
    step = jax.jit(jax.grad(lambda x, a, b: jnp.sum(jcg.sharded.mlp(
        x, a, b, mesh=mesh, axis_name="tp", config=config,
        keep_gathered_input=keep) ** 2), (0, 1, 2)))
    counted = hlo.compiled_collectives(step, x, a, b)
    assert counted.all_gather == expected.standalone_all_gathers == int(not keep)
    assert counted.fused_all_gather_matmul == expected.fused_all_gather_matmuls == 0
    assert "collective-permute" in step.lower(x, a, b).compile().as_text()


def _collectives_traced(config, mesh):
  x, a, b = fp8_mlp.inputs()
  text = jax.jit(lambda x, a, b: jcg.sharded.mlp(x, a, b, mesh=mesh, axis_name="tp",
                                                  config=config)).lower(x, a, b).as_text()
  return ("ring" if "collective_permute" in text else "") + (
      "xla" if "all_gather" in text else "")


@pytest.mark.filterwarnings("ignore:.*is not measured:RuntimeWarning")  # on purpose
def test_auto_runs_each_fp8_problem_as_decided():
  """backend="auto" with FP8: XLA's collectives where nothing was measured
  (problems_of lists the problems, keyed with the recipe), the ring where the
  plan's decision says so, and the forced implementation where
  JAX_COMM_GEMM_AUTOTUNE names one."""
  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(fp8=Fp8Recipe())
  REGISTRY.publish(stand_in_plan())
  assert _collectives_traced(config, mesh) == "xla"
  x, a, b = fp8_mlp.inputs()
  mine = jcg.backends.problems_of(
      lambda x, a, b: jcg.sharded.mlp(x, a, b, mesh=mesh, axis_name="tp", config=config),
      x, a, b)
  assert {p.op for p in mine} == {routes.AG, routes.RS}
  assert all(p.fp8 == Fp8Recipe().key and p.fp8 in p.text() for p in mine)
  REGISTRY.publish(stand_in_plan().with_decisions({p: ("ring", "measured") for p in mine}))
  assert _collectives_traced(config, mesh) == "ring"
  # Another recipe is another problem: not decided, so XLA's.
  row = dataclasses.replace(config, fp8=Fp8Recipe(scaling="row"))
  assert _collectives_traced(row, mesh) == "xla"
  REGISTRY.publish(stand_in_plan(autotune="ring"))
  assert _collectives_traced(row, mesh) == "ring"
  REGISTRY.publish(stand_in_plan(autotune="pipelined_ce"))  # no FP8 op: XLA's
  assert _collectives_traced(row, mesh) == "xla"


def test_the_fp8_candidates_are_runnable_programs():
  """autotune measures an FP8 problem with its own candidates (XLA first, so
  that the others are checked against it), running the FP8 op."""
  from jax_comm_gemm.backends import tuning
  mesh = cpu_mesh(2)
  p = routes.Problem(routes.AG, 16, fp8_mlp.D, fp8_mlp.F // 2, "float32", False, 2, True,
                   Fp8Recipe().key)
  runs = tuning._runnables(mesh, "tp", p, 0.01, REGISTRY.plan())
  assert tuple(runs) == routes.FP8_CANDIDATES[routes.AG] and tuple(runs)[0] == "xla"
  assert "pipelined_ce" in runs and routes.pallas.NAME not in runs
  outs = {name: run() for name, (run, _) in runs.items()}
  # The fused ops lower to their CPU fallback here. Each candidate casts the
  # inputs themselves (nothing computed before a cast: no code can flip), so
  # the programs differ by their GEMMs' float32 sums (tests/tolerance.py).
  for name in runs:
    for got, want in zip(jax.tree.leaves(outs[name]), jax.tree.leaves(outs["xla"])):
      assert_reduction_close(got, want, k=fp8_mlp.D, out_dtype=got.dtype, what=name)
  # "row" scaling: the fused FP8 ops cannot run it, and are not measured.
  row = dataclasses.replace(p, fp8=Fp8Recipe("row").key)
  assert [n for n, r in tuning._runnables(mesh, "tp", row, 0.01, REGISTRY.plan()).items() if r] == ["xla", "ring"]
  # Each run calls a program compiled ahead (timing.build): FP8 bytes in its HLO.
  program = next(cell.cell_contents for cell in runs["xla"][0].__closure__
                 if hasattr(cell.cell_contents, "as_text"))
  assert "f8e4m3fn" in program.as_text()
