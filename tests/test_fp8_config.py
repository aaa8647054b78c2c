"""FP8 through the front door: ``CommGemmConfig(fp8=Fp8Recipe(...))`` reaches the
FP8 collective matmuls from the functional API and the Flax modules, on every
backend a config may name; the per-layer report and the compiled counts agree.
(The FP8 ops themselves are tested in test_fp8*.py.)"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from jax_comm_gemm.runtime.registry import REGISTRY
from conftest import cpu_mesh, stand_in_plan
from jax_comm_gemm import linen as L
from jax_comm_gemm.diagnostics import hlo, report
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime.settings import Settings

FP8 = jcg.CommGemmConfig(fp8=Fp8Recipe())
# max error over max |reference| of an FP8 (E4M3) forward: test_fp8.py derives it.
TOLERANCE = 0.106


@pytest.mark.parametrize("kwargs, match", [
    ({"fp8": "tensor"}, r"CommGemmConfig.fp8 must be None or a jax_comm_gemm.fp8.Fp8Recipe"),
    ({"fp8": Fp8Recipe(), "backend": jcg.backends.PallasBackend()},
     r"CommGemmConfig.fp8: FP8 runs on XLA's collectives, the ring or the fused ops; backend "
     r"must be one of \('auto', 'xla', 'ring', 'cublasmp'\), got PallasBackend"),
    ({"fp8": Fp8Recipe("row"), "backend": "cublasmp"},
     r"backend 'cublasmp' runs FP8 with one scale per tensor"),
])
def test_a_bad_fp8_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jcg.CommGemmConfig(**kwargs)


def _mlp(config, mesh):
  return jax.jit(lambda x, a, b: jcg.sharded.mlp(x, a, b, mesh=mesh, axis_name="tp",
                                                  config=config))


def _inputs(n=32, d=64, f=128):
  keys = jax.random.split(jax.random.key(7), 3)
  return (jax.random.normal(keys[0], (n, d), jnp.float32),
          jax.random.normal(keys[1], (d, f), jnp.float32) / np.sqrt(d),
          jax.random.normal(keys[2], (f, d), jnp.float32) / np.sqrt(f))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_functional_mlp_runs_fp8_gemms_and_gathers_fp8(size):
  mesh = cpu_mesh(size)
  x, a, b = _inputs()
  text = str(jax.make_jaxpr(_mlp(FP8, mesh))(x, a, b))
  assert "f8_e4m3fn" in text
  if size > 1:  # FP8 bytes on the wire
    assert re.search(r"f8_e4m3fn\[[0-9,]+\](\{V:tp\})? = all_gather", text)
  got = np.asarray(_mlp(FP8, mesh)(x, a, b), np.float64)
  x64, a64, b64 = (np.asarray(t, np.float64) for t in (x, a, b))
  h = x64 @ a64
  want = (0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))) @ b64
  assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()
  # bf16-free: the plain config has no FP8 in it.
  assert "f8_e4m3fn" not in str(jax.make_jaxpr(_mlp(jcg.CommGemmConfig(), mesh))(x, a, b))


def test_the_linen_module_runs_fp8_gemms():
  mesh = cpu_mesh(2)
  layer = L.ColumnParallelDense(16, mesh=mesh, config=FP8)
  x = jnp.ones((8, 32))
  params = layer.init(jax.random.key(0), x)
  assert "f8_e4m3fn" in str(jax.make_jaxpr(layer.apply)(params, x))


def test_a_forced_backend_without_fp8_cannot_run_fp8():
  """JAX_COMM_GEMM_BACKEND=pallas (read into the plan) with an FP8 config is
  an error naming the variable, not a silent bf16 run."""
  mesh = cpu_mesh(2)
  REGISTRY.publish(dataclasses.replace(stand_in_plan(), settings=Settings(backend="pallas")))
  with pytest.raises(RuntimeError, match=r"JAX_COMM_GEMM_BACKEND=pallas cannot run "
                                         r"CommGemmConfig.fp8"):
    jax.eval_shape(_mlp(FP8, mesh), *_inputs())


def test_the_report_and_the_compiled_counts_agree():
  mesh = cpu_mesh(2)
  for config in (FP8, dataclasses.replace(FP8, fp8=Fp8Recipe("row"))):
    path = report.layer_path(config, mesh, "tp", jnp.bfloat16, reduce_scatter_layer=True)
    assert path.path == report.FP8_ON_XLA and "reused" in path.reason
    expected = report.expected_all_gathers(config, mesh, "tp", jnp.bfloat16)
    x, a, b = _inputs()
    step = jax.jit(jax.grad(lambda x, a, b: jnp.sum(
        jcg.sharded.mlp(x, a, b, mesh=mesh, axis_name="tp", config=config) ** 2), (0, 1, 2)))
    counted = hlo.compiled_collectives(step, x, a, b)
    data_gathers = counted.all_gather - (2 if config.fp8.scaling == "row" else 0)
    assert (data_gathers, counted.fused_all_gather_matmul) == (
        expected.standalone_all_gathers, expected.fused_all_gather_matmuls)
  one = report.layer_path(FP8, cpu_mesh(1), "tp", jnp.bfloat16)
  assert one.path == report.FP8_ON_XLA and "size 1" in one.reason
