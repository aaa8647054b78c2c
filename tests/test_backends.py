"""The cuBLASMp backend's own logic, on CPU.

On the CPU the primitives of ``backends/primitives.py`` lower to XLA's
collectives, so ``CublasMpBackend`` runs its whole path here: the routing of
the gathered operand into the weight gradient (from the primitive where the
verdict passes, from ``lax.all_gather`` where it fails) and each
reduce-scatter implementation, the ring included. Checked against float64
references, forward and gradients, and in the traced program.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh
from fused_emulation import check_against_reference, random_inputs
from jax_comm_gemm.backends import (Capability, CublasMpBackend, ring_all_gather_matmul,
                                    ring_matmul_reduce_scatter)
from jax_comm_gemm.runtime.constants import TARGETS

N, K, M = 16, 8, 24


@dataclasses.dataclass(frozen=True)
class VerdictBackend(CublasMpBackend):
  """CublasMpBackend with a chosen reuse verdict (connect's self-test on GPUs)."""
  reuse_ok: bool = True

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    return Capability(self.reuse_ok, "verdict chosen by the test")


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_ring_reduce_scatter_is_right(size, transpose_w):
  """RS(x @ w) by the ring of chunked GEMMs and ppermutes, against float64."""
  mesh = cpu_mesh(size)
  x, w = random_inputs(40 + size, [(N, K * size), (M, K * size) if transpose_w
                                   else (K * size, M)], jnp.float32)

  def local(x, w):
    return ring_matmul_reduce_scatter(x, w, "tp", transpose_w)

  w_spec = P(None, "tp") if transpose_w else P("tp", None)
  got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), w_spec),
                              out_specs=P("tp")))(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w.T if transpose_w else w, np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_ring_all_gather_matmul_is_right(size, transpose_w):
  """AllGather(x) @ w by the ring of per-shard GEMMs, against float64; its
  gathered operand equal to lax.all_gather's, bit for bit."""
  mesh = cpu_mesh(size)
  x, w = random_inputs(30 + size, [(N * size, K), (M * size, K) if transpose_w
                                   else (K, M * size)], jnp.float32)

  def local(x, w):
    y, g = ring_all_gather_matmul(x, w, "tp", transpose_w, return_gathered=True)
    return y, g, jax.lax.all_gather(x, "tp", axis=0, tiled=True)

  w_spec = P("tp", None) if transpose_w else P(None, "tp")
  y, g, want_g = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), w_spec),
                                       out_specs=(P(None, "tp"), P("tp"), P("tp"))))(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w.T if transpose_w else w, np.float64)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  # Gathers of the same bytes: exact. Every device's copy, side by side.
  np.testing.assert_array_equal(g, want_g)
  np.testing.assert_array_equal(g[:N * size], x)


@pytest.mark.parametrize("keep", [False, True], ids=["gather_again", "keep_input"])
@pytest.mark.parametrize("size", [2, 4])
def test_ring_backend_mlp(size, keep):
  """backend="ring" (both ops as rings, on any platform): the MLP block,
  forward and gradients, against float64. The row-parallel backward reuses
  the ring's gathered grad_output; only fc1's weight gradient gathers x
  again, and not with keep_gathered_input. No reduce-scatter at all."""
  mesh = cpu_mesh(size)
  config = jcg.CommGemmConfig(backend="ring")
  args = random_inputs(90 + size, [(N, K), (K, M), (M, K)], jnp.float32)

  def fn(x, w1, w2):
    local = jax.shard_map(
        lambda x, w1, w2: jcg.mlp(x, w1, w2, axis_name="tp", config=config,
                                  keep_gathered_input=keep), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return (local(x, w1, w2),)

  check_against_reference(fn, lambda x, w1, w2: (jax.nn.gelu(x @ w1) @ w2,), args, [(N, K)],
                          jnp.float32, seed=95 + size, arg_names=["x", "fc1", "fc2"])
  jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)[0] ** 2), (0, 1, 2)))(*args)
  names = [e.primitive.name for e in _equations(jaxpr.jaxpr)]
  assert names.count("all_gather") == (0 if keep else 1)
  assert "reduce_scatter" not in names and "psum_scatter" not in names
  # Forward: 2 rings of P - 1 steps; backward: 2 more, plus the transposes.
  assert names.count("ppermute") >= 4 * (size - 1)


@pytest.mark.parametrize("reduce_scatter", ["ring", "split_p2p", "xla", "pipelined_ce"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_mlp_on_each_reduce_scatter(reduce_scatter, size):
  """The MLP block, forward and gradients, with each way of reduce-scattering."""
  mesh = cpu_mesh(size)
  config = jcg.CommGemmConfig(backend=VerdictBackend(reduce_scatter=reduce_scatter))
  args = random_inputs(50 + size, [(N, K), (K, M), (M, K)], jnp.float32)

  def fn(x, w1, w2):
    local = jax.shard_map(
        lambda x, w1, w2: jcg.mlp(x, w1, w2, axis_name="tp", config=config), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return (local(x, w1, w2),)

  def reference(x, w1, w2):
    return (jax.nn.gelu(x @ w1) @ w2,)

  check_against_reference(fn, reference, args, [(N, K)], jnp.float32, seed=60 + size,
                          arg_names=["x", "fc1", "fc2"])


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
@pytest.mark.parametrize("reuse_ok", [True, False], ids=["verdict_passes", "verdict_fails"])
def test_row_parallel_weight_gradient_routing(reuse_ok, transpose_w):
  """The row-parallel backward: where the verdict passes, the AllGather+GEMM
  primitive hands its gathered grad_output to XLA's GEMM; where it fails, a
  lax.all_gather of it does. The numbers are right both ways, for w [k, m]
  and w [m, k]."""
  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(backend=VerdictBackend(reuse_ok=reuse_ok))
  h, w = random_inputs(70, [(N, M), (K, M) if transpose_w else (M, K)], jnp.float32)

  def fn(h, w):
    local = jax.shard_map(
        lambda h, w: jcg.matmul_reduce_scatter(h, w, "tp", transpose_w=transpose_w,
                                               config=config),
        mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp") if transpose_w else P("tp")),
        out_specs=P("tp"))
    return (local(h, w),)

  check_against_reference(fn, lambda h, w: (h @ (w.T if transpose_w else w),), [h, w],
                          [(N, K)], jnp.float32, seed=71, arg_names=["h", "w"])
  equations = list(_equations(
      jax.make_jaxpr(jax.grad(lambda h, w: jnp.sum(fn(h, w)[0] ** 2), (0, 1)))(h, w).jaxpr))
  (call,) = [e for e in equations if e.primitive.name == TARGETS["all_gather_matmul"]]
  gathers = [e for e in equations if e.primitive.name == "all_gather"]
  assert call.params["transpose_w"] != transpose_w
  assert call.params["return_gathered"] == reuse_ok
  assert len(gathers) == (0 if reuse_ok else 1)


def test_asking_for_the_gathered_operand_without_a_verdict_fails():
  """A caller that skips routes.gathered_route cannot get the
  operand out of a workspace whose layout nothing verified."""
  mesh = cpu_mesh(2)
  x, w = random_inputs(80, [(N, K), (K, M)], jnp.float32)

  def local(x, w):
    return VerdictBackend(reuse_ok=False).all_gather_matmul(
        x, w, "tp", transpose_w=False, return_gathered=True)[0]

  with pytest.raises(RuntimeError, match="without a passing verdict: verdict chosen by"):
    jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                 out_specs=P(None, "tp")), x, w)


def _equations(jaxpr):
  """Every equation, in sub-jaxprs too (shard_map, custom_vjp, pjit)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (list, tuple)) else [value]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


def _checked_mlp_gradient_equations(backend, seed: int) -> list:
  """The MLP block on `backend` over 2 CPU devices: forward and gradients
  checked against float64; returns the equations of its gradient's jaxpr."""
  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(backend=backend)
  args = random_inputs(seed, [(N, K), (K, M), (M, K)], jnp.float32)

  def fn(x, w1, w2):
    local = jax.shard_map(
        lambda x, w1, w2: jcg.mlp(x, w1, w2, axis_name="tp", config=config), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return (local(x, w1, w2),)

  check_against_reference(fn, lambda x, w1, w2: (jax.nn.gelu(x @ w1) @ w2,), args, [(N, K)],
                          jnp.float32, seed=seed + 1, arg_names=["x", "fc1", "fc2"])
  jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)[0] ** 2), (0, 1, 2)))(*args)
  return list(_equations(jaxpr.jaxpr))


@pytest.mark.parametrize("reuse_ok", [True, False], ids=["verdict_passes", "verdict_fails"])
def test_own_algorithm_mlp(reuse_ok):
  """The project's own AllGather+GEMM through CublasMpBackend: the MLP block,
  forward and gradients, against float64. Both AllGather+GEMM calls (fc1
  forward, fc2's dgrad, TN) run pipelined_ce, which asks for the operand only
  where it is reused."""
  algorithm = "pipelined_ce"
  equations = _checked_mlp_gradient_equations(
      VerdictBackend(all_gather_algorithm=algorithm, reuse_ok=reuse_ok), seed=100)
  calls = [e for e in equations if e.primitive.name == TARGETS["all_gather_matmul"]]
  assert len(calls) == 2
  assert all(c.params["algorithm"] == jcg.config.ALGORITHMS[algorithm] for c in calls)
  # By transpose_w: fc2's dgrad (TN) hands its operand on, fc1 (NN) gathers x again.
  reused = {True: reuse_ok, False: False}
  for c in calls:
    assert c.params["return_gathered"] == reused[c.params["transpose_w"]], c.params
  gathers = [e for e in equations if e.primitive.name == "all_gather"]
  assert len(gathers) == (1 if reuse_ok else 2)


@pytest.mark.parametrize("all_gather_algorithm", ["split_p2p", "pipelined_ce"])
def test_own_reduce_scatter_mlp(all_gather_algorithm, reduce_scatter="pipelined_ce"):
  """The project's own GEMM+ReduceScatters through CublasMpBackend: the MLP
  block, forward and gradients, against float64; both GEMM+ReduceScatter calls
  (fc2 forward, fc1's dgrad, TN) run it, and no psum_scatter of XLA's is left."""
  equations = _checked_mlp_gradient_equations(
      VerdictBackend(all_gather_algorithm=all_gather_algorithm, reduce_scatter=reduce_scatter,
                     reuse_ok=True), seed=102)
  calls = [e for e in equations if e.primitive.name == TARGETS["matmul_reduce_scatter"]]
  assert sorted(c.params["transpose_w"] for c in calls) == [False, True]
  assert all(c.params["algorithm"] == jcg.config.ALGORITHMS[reduce_scatter] for c in calls)
  assert not [e for e in equations if e.primitive.name == "reduce_scatter"]


def test_the_cublasmp_backend_on_a_group_of_one_runs_xla():
  """A CublasMpBackend given as the backend, on an axis of size 1: both ops
  run XLA's (a group of one has no communicator to call), the gathered
  operand included."""
  mesh = cpu_mesh(1)
  config = jcg.CommGemmConfig(backend=CublasMpBackend())
  x = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (16, 4), jnp.float32)

  def local(x, w):
    y, g = jcg.all_gather_matmul(x, w, "tp", return_gathered=True, config=config)
    return y, g, jcg.matmul_reduce_scatter(y, w.T, "tp", config=config)

  program = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                          out_specs=(P(None, "tp"), P("tp"), P("tp")))
  text = str(jax.make_jaxpr(program)(x, w))
  assert not any(target in text for target in TARGETS.values()), text
  y, g, z = jax.jit(program)(x, w)
  np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(g, x)  # a copy: exact
  np.testing.assert_allclose(z, (x @ w) @ w.T, rtol=1e-4, atol=1e-4)
