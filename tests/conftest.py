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
