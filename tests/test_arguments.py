"""The collective matmuls' own arguments, as a new user would try them: each
bad one is an error that names it; the eager (not jitted) shard_map works."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from jax_comm_gemm.runtime.registry import REGISTRY
from conftest import cpu_mesh, stand_in_plan
from jax_comm_gemm.runtime.settings import Settings


def _eager(fn, mesh, in_specs, out_specs):
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def test_the_local_api_runs_in_an_eager_shard_map_forward_and_backward():
  """Not jitted: values and gradients against float64."""
  mesh = cpu_mesh(2)
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (8, 6), jnp.float32)
  w1 = jax.random.normal(keys[1], (6, 10), jnp.float32)
  w2 = jax.random.normal(keys[2], (10, 6), jnp.float32)

  def local(x, w1, w2):
    return jcg.row_parallel_dense(jcg.column_parallel_dense(x, w1, axis_name="tp"), w2,
                                  axis_name="tp")

  f = _eager(local, mesh, (P("tp"), P(None, "tp"), P("tp")), P("tp"))
  x64, a64, b64 = (np.asarray(t, np.float64) for t in (x, w1, w2))
  np.testing.assert_allclose(f(x, w1, w2), x64 @ a64 @ b64, rtol=1e-5, atol=1e-5)
  dx, da, db = jax.grad(lambda *a: jnp.sum(f(*a)), (0, 1, 2))(x, w1, w2)
  ones = np.ones((8, 6))
  np.testing.assert_allclose(dx, ones @ (a64 @ b64).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(da, x64.T @ (ones @ b64.T), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(db, (x64 @ a64).T @ ones, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"config": "xla"}, TypeError, r"all_gather_matmul: `config` must be a "
                                   r"jax_comm_gemm.CommGemmConfig"),
    ({"config": None}, TypeError, r"`config` must be"),
    ({"config": {"backend": "xla"}}, TypeError, r"`config` must be"),
    ({"return_gathered": "yes"}, TypeError, r"`return_gathered` must be True or False"),
    ({"return_gathered": 1}, TypeError, r"`return_gathered` must be True or False"),
    ({"keep_gathered_input": object()}, TypeError, r"`keep_gathered_input` must be"),
])
def test_bad_arguments_of_all_gather_matmul_name_themselves(kwargs, error, match):
  mesh = cpu_mesh(2)
  f = _eager(lambda x, w: jcg.all_gather_matmul(x, w, "tp", **kwargs), mesh,
             (P("tp"), P(None, "tp")), P(None, "tp"))
  with pytest.raises(error, match=match):
    jax.eval_shape(f, jnp.ones((8, 4)), jnp.ones((4, 6)))


def test_numpy_bools_are_bools():
  mesh = cpu_mesh(2)
  f = _eager(lambda x, w: jcg.all_gather_matmul(x, w, "tp", return_gathered=np.True_)[1],
             mesh, (P("tp"), P(None, "tp")), P("tp"))
  assert jax.eval_shape(f, jnp.ones((8, 4)), jnp.ones((4, 6))).shape == (16, 4)  # 8 a shard


@pytest.mark.parametrize("value", [0, 1, "no", True])
def test_reuse_gathered_takes_none_or_false(value):
  with pytest.raises(ValueError, match=r"CommGemmConfig.reuse_gathered must be None"):
    jcg.CommGemmConfig(reuse_gathered=value)
  assert jcg.CommGemmConfig(reuse_gathered=np.False_).reuse_gathered is False


def test_a_forced_backend_that_cannot_run_names_the_variable():
  """JAX_COMM_GEMM_BACKEND=cublasmp where cuBLASMp cannot run: the error speaks
  of the variable, not of a backend= the user never wrote."""
  REGISTRY.publish(dataclasses.replace(stand_in_plan(cublasmp=False),
                                       settings=Settings(backend="cublasmp")))
  with pytest.raises(RuntimeError, match=r"JAX_COMM_GEMM_BACKEND=cublasmp was requested but "
                                         r"cuBLASMp is unavailable"):
    jcg.backends.resolve_backend(jcg.CommGemmConfig(), "tp", cpu_mesh(2))


# Every flag of the public FP8 ops, and how to call the op with it.
_W8 = jnp.ones((16, 16), jnp.float8_e4m3fn)
FP8_FLAGS = {
    "fp8_all_gather_matmul": ("transpose_w", "keep_gathered_input", "return_gathered"),
    "fp8_matmul_reduce_scatter": ("transpose_w", "reuse_gathered"),
    "fp8_gemm_tn": ("fast_accum",),
    "cublaslt_gemm_tn": ("timed", "fast_accum"),
    "weight_copies": ("transpose_w", "with_amax"),
}


def _call_fp8(op: str, **flags):
  if op == "fp8_gemm_tn":
    return jcg.fp8.fp8_gemm_tn(_W8, _W8, 1.0, 1.0, jnp.float32, **flags)
  if op == "cublaslt_gemm_tn":
    return jcg.fp8.cublaslt_gemm_tn(_W8, _W8, 1.0, 1.0, out_dtype=jnp.float32, **flags)
  if op == "weight_copies":
    return jcg.fp8.weight_copies(jnp.ones((16, 16)), jnp.float8_e4m3fn, scaling="tensor",
                                 **{"transpose_w": False, **flags})
  f = _eager(lambda x, w: getattr(jcg.fp8, op)(x, w, "tp", **flags), cpu_mesh(2),
             (P("tp"), P(None, "tp")), P("tp"))
  return jax.eval_shape(f, jnp.ones((16, 16)), jnp.ones((16, 16)))


@pytest.mark.parametrize("op, flag", [(op, flag) for op, flags in FP8_FLAGS.items()
                                      for flag in flags])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_flags_of_the_fp8_ops_must_be_bools(op, flag, value):
  """bool("no") is True: a flag that is not a bool is refused by name."""
  with pytest.raises(TypeError, match=rf"{op}: `{flag}` must be True or False"):
    _call_fp8(op, **{flag: value})
  _call_fp8(op, **{flag: np.False_})  # numpy's bools are bools
