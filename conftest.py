"""pytest's set-up for the whole checkout: the tests under tests/ and the
doctests of the package's modules (``make test`` runs both).

The pytest process stays on the CPU (JAX_PLATFORMS=cpu), also on a GPU
machine: the GPU tests run in worker processes of their own (tests/gpu/),
which must find the GPUs' memory free. 8 simulated CPU devices. Both must be
set before jax is imported.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
