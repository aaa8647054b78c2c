"""The plan is an argument: an entry (tests/plan_entries.py) reads the plan in
force once and passes it down, and the routes carry it. Every module's
``current_plan`` is guarded here: a read from anywhere but an entry fails the
call. A backend with no plan bound says how to bind one instead of reading it,
and a caller below an entry that passes no plan is an error."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.runtime.plan as plan_lib
from call_path import forget_traces
from conftest import cpu_mesh, stand_in_plan
from plan_entries import ENTRIES, PACKAGE
from jax_comm_gemm import collective_matmul
from jax_comm_gemm.backends import routes, tuning
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul
from jax_comm_gemm.runtime import registry
from jax_comm_gemm.runtime.capability import Capability, VerdictKey
from jax_comm_gemm.runtime.constants import GATHERED_LAYOUTS, TARGETS

FUSED_AG = TARGETS["all_gather_matmul"]
UNBOUND = "has no routing plan bound"


@pytest.fixture
def guarded(monkeypatch):
  """Each package module's ``current_plan``, guarded: a read from an entry
  returns the plan in force (and is listed), any other raises an
  AssertionError naming the reader."""
  real = registry.current_plan
  reads = []

  def guard():
    code = sys._getframe(1).f_code
    path = pathlib.Path(code.co_filename).resolve()
    where = (str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE) else
             code.co_filename, code.co_name)
    if where not in ENTRIES:
      raise AssertionError(f"the plan in force was read below an entry: {where}")
    reads.append(where)
    return real()

  # The readers' names for it; the registry keeps its own (a module imported
  # later takes that one, and nothing here outlives the test).
  for name, module in list(sys.modules.items()):
    if (name.startswith("jax_comm_gemm") and module is not registry
        and getattr(module, "current_plan", None) is real):
      monkeypatch.setattr(module, "current_plan", guard)
  return reads


def _plan(mesh, autotune="off"):
  """cuBLASMp "runs", tp connected, the gathered operand's verdicts passing
  (layout "tail", every algorithm "auto" may choose), measuring as `autotune` says."""
  verdicts = {VerdictKey(2, algorithm, "float32", transpose, "tail"):
              Capability(True, "stand-in verdict") for transpose in (False, True)
              for algorithm in ("default", "split_p2p", "pipelined_ce")}
  return stand_in_plan(layout="tail", autotune=autotune).with_axis(mesh, "tp", 7, verdicts)


def _fused_calls(jaxpr) -> list[tuple[int, bool]]:
  """(layout, return_gathered) of each fused AllGather+GEMM, nested ones too."""
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == FUSED_AG:
        found.append((eqn.params["layout"], eqn.params["return_gathered"]))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("backend", ["cublasmp", "CublasMpBackend()", "AutoBackend()"])
def test_a_layer_reads_the_plan_at_its_entry_and_its_vjp_runs_anywhere(guarded, backend):
  """The global column- then row-parallel layers on cuBLASMp's route (the
  config's name, or a user's backend object, bound at the entry): traced under
  ``plan.use(p)``, the plan is read at the two entries alone; the backward,
  traced after the scope, reads nothing and binds p's layout and verdicts."""
  mesh = cpu_mesh(2)
  given = {"cublasmp": "cublasmp",
           "CublasMpBackend()": jcg.backends.CublasMpBackend(reduce_scatter="split_p2p"),
           "AutoBackend()": jcg.backends.AutoBackend(jcg.backends.CublasMpBackend(reduce_scatter="split_p2p"))}
  config = jcg.CommGemmConfig(backend=given[backend], reduce_scatter="split_p2p")
  rng = np.random.default_rng(5)
  x, k1, k2, ct = (rng.standard_normal(s).astype(np.float32)
                   for s in ((8, 6), (6, 4), (4, 6), (8, 6)))

  def layers(x, k1, k2):
    h = jcg.sharded.column_parallel_dense(x, k1, mesh=mesh, config=config)
    return jcg.sharded.row_parallel_dense(h, k2, mesh=mesh, config=config)

  forget_traces()
  # "auto" forced onto the fused AllGather+GEMM, so that its route is the fused one too.
  with plan_lib.use(_plan(mesh, autotune="cublasmp_split_p2p")):
    y, backward = jax.vjp(layers, x, k1, k2)
  assert sorted(set(guarded)) == [("jax_comm_gemm/layers/dense.py", "column_global"),
                                  ("jax_comm_gemm/layers/dense.py", "row_global")]
  guarded.clear()
  dx, dk1, dk2 = backward(ct)
  # The row-parallel backward's AllGather+GEMM hands out the gathered
  # grad_output under p's verdict, at p's layout; the plan in force here has
  # neither a verdict nor the axis connected.
  assert (GATHERED_LAYOUTS["tail"], True) in _fused_calls(jax.make_jaxpr(backward)(ct))
  assert guarded == []
  x64, k164, k264, ct64 = (a.astype(np.float64) for a in (x, k1, k2, ct))
  h64 = x64 @ k164
  np.testing.assert_allclose(y, h64 @ k264, rtol=1e-5, atol=1e-5)
  dh = ct64 @ k264.T
  np.testing.assert_allclose(dk2, h64.T @ ct64, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dk1, x64.T @ dh, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, dh @ k164.T, rtol=1e-5, atol=1e-5)


def _local_all_gather_matmul(mesh, backend, return_gathered):
  out = (P(None, "tp"), P("tp")) if return_gathered else P(None, "tp")
  return jax.shard_map(
      lambda x, w: backend.all_gather_matmul(x, w, "tp", transpose_w=False,
                                             return_gathered=return_gathered),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=out)


def test_a_backend_binds_where_it_is_resolved_and_an_unbound_one_says_how(guarded):
  """A user's backend object, called directly with no plan bound, is an
  error that says how to bind one (never a read of the plan in force);
  resolved at an entry (``jcg.backends.resolve_backend``), it carries that plan to
  wherever its ops are traced."""
  mesh = cpu_mesh(2)
  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  user = jcg.backends.AutoBackend(jcg.backends.CublasMpBackend())
  p = _plan(mesh, autotune="cublasmp_split_p2p")
  with plan_lib.use(p):
    for backend in (user, user.fused):
      with pytest.raises(RuntimeError, match=UNBOUND):
        jax.eval_shape(_local_all_gather_matmul(mesh, backend, True), x, w)
    with pytest.raises(RuntimeError, match=UNBOUND):
      user.gathered_reuse(2, "float32", False)
    with pytest.raises(RuntimeError, match=UNBOUND):  # the FP8 ops' collectives too
      jax.eval_shape(jax.shard_map(
          lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=Fp8Recipe(),
                                             collectives=user.fused),
          mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")), x, w)
    resolved = jcg.backends.resolve_backend(jcg.CommGemmConfig(backend=user), "tp", mesh)
  assert guarded == [("jax_comm_gemm/backends/routes.py", "choose_backend")]
  assert resolved.plan is p and resolved.fused.plan is p
  # Outside the scope: the plan in force has no verdict, so a bind that read
  # it would refuse the gathered operand.
  jaxpr = jax.make_jaxpr(_local_all_gather_matmul(mesh, resolved, True))(x, w)
  assert _fused_calls(jaxpr) == [(GATHERED_LAYOUTS["tail"], True)]
  assert routes.bound(user, p) == resolved


def test_below_an_entry_a_missing_plan_is_an_error(guarded):
  """The functions below the entries take the plan; None is an error naming
  the function, and a missing one Python's, never a read of the plan in force."""
  mesh = cpu_mesh(2)
  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  for op, args in ((collective_matmul.all_gather_matmul_unchecked,
                    dict(return_gathered=False, keep_gathered_input=False)),
                   (collective_matmul.matmul_reduce_scatter_unchecked, {})):
    with pytest.raises(TypeError, match=rf"{op.__name__}: `plan` is the routing plan"):
      op(x, w, "tp", transpose_w=False, precision=None, config=jcg.CommGemmConfig(),
         plan=None, **args)
  with pytest.raises(TypeError, match="op_route: `plan`"):
    routes.op_route(jcg.CommGemmConfig(), routes.AG, x, w, False, "tp", None, False, None)
  problem = routes.Problem(routes.AG, 8, 16, 16, "float32", False, 2)
  with pytest.raises(TypeError, match="plan"):
    tuning.step_plans([problem], {problem: ("xla", "m")})
  with pytest.raises(TypeError, match="plan"):
    tuning._runnables(mesh, "tp", problem, 0.01)
  assert guarded == []
