"""Test set-up: 8 simulated CPU devices, and meshes.

The pytest process itself stays on the CPU (JAX_PLATFORMS=cpu), also on a GPU
machine: the GPU tests run in worker processes of their own (tests/gpu/),
which must find the GPUs' memory free. XLA_FLAGS must be set before jax is
imported.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


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


import jax_comm_gemm.runtime.plan as plan_lib  # noqa: E402
from jax_comm_gemm.runtime.capability import Capability  # noqa: E402
from jax_comm_gemm.runtime.settings import Settings  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_plan():
  """A test may publish routing plans (connect, autotune, or by hand): the
  next test starts from the plan in force before it."""
  before = plan_lib.published()
  yield
  plan_lib.publish(before)


def stand_in_plan(*, cublasmp: bool = True, layout: str = "tail",
                  **settings) -> plan_lib.Plan:
  """A plan as if cuBLASMp could run here (or not), with `settings` and no
  disk cache; nothing connected, measured or verified yet."""
  return plan_lib.Plan(Settings(**{"autotune_cache": "", **settings}),
                       Capability(cublasmp, "stand-in"), layout)
