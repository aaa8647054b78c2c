"""The routing plan is explicit: ``connect`` and ``autotune`` replace the
process's plan in the registry, which no ``jax.jit`` keys on, so they make no
program compile again. A program traced before them keeps its route, and its
trace warned of that; a program traced after them takes their decisions, the
library's own jitted programs included (they key on the plan in force).
Tracing writes nothing. Counted with jit's ``_cache_size()`` and with traces."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
import jax_comm_gemm.backends.tuning as tuning
from jax_comm_gemm.runtime import REGISTRY
from jax_comm_gemm.runtime.constants import TARGETS
from fake_native import install_fake_native

X, W = jnp.ones((16, 8)), jnp.ones((8, 16))
FUSED = TARGETS["all_gather_matmul"]


@pytest.fixture
def mesh(monkeypatch):
  """A 2-CPU mesh where cuBLASMp "runs" (a stand-in extension), nothing connected."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  install_fake_native(monkeypatch)
  return Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))


def _local(x, w):
  return jcg.all_gather_matmul(x, w, "tp")


def _library_program(mesh):
  """A new jitted program of the library's AllGather+GEMM (backend "auto")."""
  return jax.jit(jax.shard_map(_local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                               out_specs=P(None, "tp")))


def _jaxpr(program) -> str:
  return str(program.trace(X, W).jaxpr)


def _measured(monkeypatch, implementation: str):
  """autotune's measurement stands in: every problem measures fastest on `implementation`."""
  monkeypatch.setattr(tuning, "measure", lambda mesh, axis, problems, plan, **_: {
      p: (implementation, "measured (stand-in)") for p in problems})


def test_connect_and_autotune_recompile_no_unrelated_program(mesh, monkeypatch):
  traces = []

  @jax.jit
  def unrelated(v):
    traces.append(1)
    return v * 2

  unrelated(jnp.ones(3))
  with pytest.warns(RuntimeWarning, match="not connected"):
    library = _library_program(mesh)
    library(X, W)
  assert unrelated._cache_size() == library._cache_size() == 1
  jcg.connect(mesh, "tp")
  _measured(monkeypatch, "ring")
  assert jcg.backends.autotune(mesh, "tp", jcg.backends.problems_of(_library_program(mesh), X, W))
  unrelated(jnp.ones(3))
  library(X, W)
  assert unrelated._cache_size() == library._cache_size() == 1
  assert len(traces) == 1


def test_a_program_traced_before_connect_keeps_its_route_with_a_warning(mesh, monkeypatch):
  """Traced unconnected, a program runs XLA's collectives and keeps them after
  connect, as its trace's warning said; the same function jitted after
  connect runs the fused op (which the environment forces at this size)."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE", "pipelined_ce")
  before = _library_program(mesh)
  with pytest.warns(RuntimeWarning, match="a program traced now keeps XLA's collectives "
                                          "after connect"):
    np.testing.assert_allclose(before(X, W), np.full((16, 16), 8.0))  # sums of ones: exact
  jcg.connect(mesh, "tp")
  assert FUSED not in _jaxpr(before)
  np.testing.assert_allclose(before(X, W), np.full((16, 16), 8.0))
  assert before._cache_size() == 1
  assert FUSED in _jaxpr(_library_program(mesh))


def test_a_program_traced_before_autotune_keeps_its_route_with_a_warning(mesh, monkeypatch):
  """Unmeasured, the rule of thumb routes a problem (XLA's collectives at this
  size) and the trace warns that the program keeps that route; after autotune
  measured the ring fastest, that program still runs XLA's, and a program
  traced after it runs the ring."""
  jcg.connect(mesh, "tp")
  x, w = jnp.ones((32, 8)), jnp.ones((8, 16))  # traced by no other test: the warning is new
  before = _library_program(mesh)
  with pytest.warns(RuntimeWarning, match="keeps that route when autotune measures it"):
    before(x, w)
  _measured(monkeypatch, "ring")
  jcg.backends.autotune(mesh, "tp", jcg.backends.problems_of(_library_program(mesh), x, w))
  assert "ppermute" not in str(before.trace(x, w).jaxpr)
  assert "ppermute" in str(_library_program(mesh).trace(x, w).jaxpr)
  assert before._cache_size() == 1


def test_the_librarys_own_jitted_programs_key_on_the_plan(mesh, monkeypatch):
  """jcg.sharded's layers run in jitted programs of the library's: one traced
  before connect is not reused by a program traced after it."""
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE", "pipelined_ce")
  x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("tp")))
  w = jax.device_put(W, jax.sharding.NamedSharding(mesh, P(None, "tp")))

  def program():  # a new function each time: the library's jitted layer is the same
    return jax.jit(lambda x, w: jcg.sharded.column_parallel_dense(x, w, mesh=mesh,
                                                                 axis_name="tp"))

  with pytest.warns(RuntimeWarning, match="not connected"):
    assert FUSED not in str(program().trace(x, w).jaxpr)
  jcg.connect(mesh, "tp")
  assert FUSED in str(program().trace(x, w).jaxpr)


def test_tracing_writes_nothing(mesh):
  """Tracing (and listing a step's problems) reads the registry and leaves it as it was."""
  jcg.connect(mesh, "tp")

  def state():
    return {k: (v.copy() if isinstance(v, (dict, set)) else v)
            for k, v in vars(REGISTRY).items() if "lock" not in k}

  was = state()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the rule of thumb's, where this trace is the first
    _library_program(mesh).trace(X, W)
  problems = jcg.backends.problems_of(_library_program(mesh), X, W)
  # The op's route holds its backward's too (a GEMM+ReduceScatter), decided at the call.
  assert [p.op for p in problems] == ["all_gather_matmul", "matmul_reduce_scatter"]
  assert state() == was


def test_problems_of_lists_a_step_traced_already(mesh):
  """problems_of traces under a plan of its own: a step jitted and run
  before is traced again there (its problems listed) and not here."""
  jcg.connect(mesh, "tp")
  program = _library_program(mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    program(X, W)
  assert len(jcg.backends.problems_of(program, X, W)) == 2  # the op and its backward's
  assert program._cache_size() == 1
