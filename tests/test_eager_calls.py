"""Eager calls of the layers and modules reuse their compiled programs.

The global-array layers wrap ``shard_map`` in jitted functions of module scope
(``layers/dense.py``), so calling a layer or a Flax module outside ``jax.jit``
compiles once per shape and options; before, every call traced and compiled a
fresh closure (about 23 ms a call). Compilations are counted through
``jax.monitoring``.
"""

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

import jax_comm_gemm as jcg
from conftest import cpu_mesh, stand_in_plan
from jax_comm_gemm.runtime.registry import REGISTRY
from jax_comm_gemm import linen as L
from jax_comm_gemm import nnx as N

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
  events = []

  def listener(event, duration, **kwargs):
    if event == COMPILE_EVENT:
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _calls(make_call):
  """Compilations during the first call, and during two more calls."""
  with count_compiles() as first:
    jax.block_until_ready(make_call())
  with count_compiles() as later:
    for _ in range(2):
      jax.block_until_ready(make_call())
  return len(first), len(later)


def test_sharded_layers_compile_once():
  mesh = cpu_mesh(4)
  x, kernel, fc2 = jnp.ones((16, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))
  for call in (lambda: jcg.sharded.column_parallel_dense(x, kernel, mesh=mesh),
               lambda: jcg.sharded.row_parallel_dense(jnp.ones((16, 16)), fc2, mesh=mesh),
               lambda: jcg.sharded.mlp(x, kernel, fc2, mesh=mesh)):
    first, later = _calls(call)
    assert first >= 1 and later == 0, (first, later)


def test_linen_module_compiles_once():
  mesh = cpu_mesh(4)
  model = L.SequenceParallelMLP(32, mesh=mesh)
  x = jnp.ones((16, 8))
  params = model.init(jax.random.key(0), x)
  first, later = _calls(lambda: model.apply(params, x))
  assert later == 0, (first, later)


def test_nnx_module_compiles_once():
  mesh = cpu_mesh(4)
  with jax.set_mesh(mesh):
    model = N.SequenceParallelMLP(8, 32, rngs=nnx.Rngs(0))
    x = jnp.ones((16, 8))
    first, later = _calls(lambda: model(x))
  assert later == 0, (first, later)


def test_another_option_compiles_again():
  """Options are static: a new value compiles a new program, once, and the
  first value's program is still there."""
  mesh = cpu_mesh(2)
  x, kernel = jnp.ones((8, 8)), jnp.ones((8, 8))

  def call(keep):
    return lambda: jcg.sharded.column_parallel_dense(
        x, kernel, mesh=mesh, keep_gathered_input=keep, precision=jax.lax.Precision.HIGHEST)

  _calls(call(False))
  first, later = _calls(call(True))
  assert first >= 1 and later == 0, (first, later)
  assert _calls(call(False)) == (0, 0)


def test_a_new_routing_plan_compiles_again_once():
  """The routing plan is part of jit's key: under a new plan (connect or
  autotune publish one) a layer compiles once more, and not again."""
  mesh = cpu_mesh(2)
  x, kernel = jnp.ones((8, 8)), jnp.ones((8, 8))
  call = lambda: jcg.sharded.column_parallel_dense(x, kernel, mesh=mesh)  # noqa: E731
  _calls(call)
  REGISTRY.publish(stand_in_plan(cublasmp=False, autotune="off"))
  first, later = _calls(call)
  assert first >= 1 and later == 0, (first, later)
