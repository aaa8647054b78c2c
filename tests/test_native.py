"""The native side as seen from a CPU machine: no cuBLASMp, and no crash.

cuBLASMp needs a GPU driver, so here it must come back as "unavailable, and
why"; the cuBLASMp primitives, lowered for CPU, fall back to XLA's collectives;
the backend choice follows the config and the environment variable.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm
from conftest import cpu_mesh
from fused_emulation import EmulatedFusedBackend, random_inputs
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.backends import XlaBackend, resolve_backend
from jax_comm_gemm.backends import primitives
from jax_comm_gemm.runtime import plan as plan_lib
from jax_comm_gemm.runtime.constants import ALGORITHMS
from jax_comm_gemm.runtime.registry import REGISTRY
from jax_comm_gemm.runtime.settings import Settings

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="checks the behaviour without GPUs")


def test_cublasmp_version_is_zero_without_gpu():
  """cublasmp_version() reports 0 (no cuBLASMp here) and does not raise."""
  assert jax_comm_gemm.cublasmp_version() == 0


def test_cublasmp_status_gives_reason():
  """cublasmp_status() is not ok and says why."""
  status = jax_comm_gemm.cublasmp_status()
  assert not status.ok
  assert isinstance(status.reason, str) and status.reason
  assert "cpu" in status.reason.lower()


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_ffi_all_gather_matmul_falls_back_on_cpu(transpose_w):
  """The cuBLASMp AllGather+GEMM primitive, lowered for CPU, computes
  AG(x) @ w and hands out the gathered x, through XLA's collectives."""
  mesh = cpu_mesh(4)
  n, k, m = 32, 16, 24
  x, w = random_inputs(21 + transpose_w, [(n, k), (m, k) if transpose_w else (k, m)],
                       jnp.float32)

  def local(x, w):
    y, gathered = primitives.all_gather_matmul(x, w, "tp", transpose_w=transpose_w,
                                               return_gathered=True, algorithm=1,
                                            layout="tail")
    (y_only,) = primitives.all_gather_matmul(x, w, "tp", transpose_w=transpose_w,
                                          return_gathered=False, algorithm=0,
                                          layout="front")
    return y, gathered[None], y_only

  w_spec = P("tp", None) if transpose_w else P(None, "tp")
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), w_spec),
                             out_specs=(P(None, "tp"), P("tp"), P(None, "tp"))))
  y, gathered, y_only = fn(x, w)
  expected = np.asarray(x, np.float64) @ np.asarray(w.T if transpose_w else w, np.float64)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  # Exact: on CPU both calls lower to the same XLA ops on the same operands in
  # one program (the algorithm and layout are the custom call's, which is not
  # there), and XLA computes them once.
  np.testing.assert_array_equal(y_only, y)
  np.testing.assert_array_equal(gathered, np.broadcast_to(x, (4, n, k)))  # copies: exact


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_ffi_matmul_reduce_scatter_falls_back_on_cpu(transpose_w):
  """The cuBLASMp GEMM+ReduceScatter primitive, lowered for CPU, computes
  this shard's tokens of x @ w through XLA's collectives."""
  mesh = cpu_mesh(4)
  n, k, m = 32, 16, 24
  x, w = random_inputs(31 + transpose_w, [(n, k), (m, k) if transpose_w else (k, m)],
                       jnp.float32)

  def local(x, w):
    return primitives.matmul_reduce_scatter(x, w, "tp", transpose_w=transpose_w,
                                         algorithm=ALGORITHMS["pipelined_ce"])

  w_spec = P(None, "tp") if transpose_w else P("tp", None)
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), w_spec),
                             out_specs=P("tp", None)))
  expected = np.asarray(x, np.float64) @ np.asarray(w.T if transpose_w else w, np.float64)
  np.testing.assert_allclose(fn(x, w), expected, rtol=1e-5, atol=1e-5)


def test_requesting_cublasmp_without_it_raises():
  """backend='cublasmp' where it cannot run is an error that says so."""
  with pytest.raises(RuntimeError, match=r"backend='cublasmp' was requested but "
                     r"cuBLASMp is unavailable: "):
    resolve_backend(CommGemmConfig(backend="cublasmp"))


def test_auto_backend_is_xla_on_cpu():
  assert resolve_backend(CommGemmConfig()) == XlaBackend()


@pytest.mark.parametrize("backend", ["cublasmp", "auto", EmulatedFusedBackend()],
                         ids=["cublasmp", "auto", "instance"])
def test_environment_forces_xla(backend):
  """JAX_COMM_GEMM_BACKEND=xla overrides any configured backend (A/B runs),
  even a request for cuBLASMp that could not be met. The variable is read once,
  into the routing plan (at connect or first use), so the test runs under a
  plan made from it."""
  def plan(environ):
    return dataclasses.replace(REGISTRY.plan(), settings=Settings.from_environ(environ))

  with plan_lib.use(plan({"JAX_COMM_GEMM_BACKEND": " XLA "})):
    assert resolve_backend(CommGemmConfig(backend=backend)) == XlaBackend()
  with plan_lib.use(plan({})), pytest.raises(RuntimeError, match="cuBLASMp is unavailable"):
    resolve_backend(CommGemmConfig(backend="cublasmp"))  # not forced: the request stands


def test_fused_options_on_xla_say_so(monkeypatch):
  """A cuBLASMp option does nothing where the layers run on XLA, and a warning
  says which option and why."""
  monkeypatch.delenv("JAX_COMM_GEMM_BACKEND", raising=False)
  config = CommGemmConfig(reduce_scatter="ring", all_gather_algorithm="pipelined_ce")
  with pytest.warns(RuntimeWarning, match=r"CommGemmConfig\(all_gather_algorithm='pipelined_ce', "
                    r"reduce_scatter='ring'\) has no effect: the layers run on XLA's "
                    r"collectives \(cuBLASMp is unavailable: "):
    assert resolve_backend(config) == XlaBackend()
