"""Test helpers: meshes and routing plans. (The CPU platform and its 8
simulated devices are set up by the checkout's root conftest.py.)"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_comm_gemm.runtime.plan as plan_lib
from tests.cpu_flags import cpu_test_flags
from jax_comm_gemm.runtime.capability import Capability
from jax_comm_gemm.runtime.registry import REGISTRY
from jax_comm_gemm.runtime.settings import Settings


# The XLA flags of the CPU processes that tests start (the examples, the
# multi-process workers): faster compiles, as the root conftest.py sets them
# for the pytest process (tests/cpu_flags.py says why and which).
CPU_TEST_FLAGS = cpu_test_flags()


def cpu_mesh(size: int, axis_name: str = "tp") -> Mesh:
  """A 1-D mesh over the first `size` CPU devices."""
  devices = jax.devices("cpu")
  if len(devices) < size:
    pytest.skip(f"needs {size} CPU devices, have {len(devices)}")
  return Mesh(np.asarray(devices[:size]), (axis_name,))


@pytest.fixture(params=[2, 4, 8], ids=lambda n: f"tp{n}")
def tp_mesh(request) -> Mesh:
  """1-D tensor-parallel meshes of 2, 4 and 8 simulated CPU devices."""
  return cpu_mesh(request.param)


@pytest.fixture(autouse=True)
def _restore_plan():
  """A test may publish routing plans (connect, autotune, or by hand): the
  next test starts from the plan in force before it."""
  before = REGISTRY._published
  yield
  REGISTRY.publish(before)


def stand_in_plan(*, cublasmp: bool = True, layout: str = "tail",
                  **settings) -> plan_lib.Plan:
  """A plan as if cuBLASMp could run here (or not), with `settings` and no
  disk cache; nothing connected, measured or verified yet."""
  return plan_lib.Plan(Settings(**{"autotune_cache": "", **settings}),
                       Capability(cublasmp, "stand-in"), layout)
