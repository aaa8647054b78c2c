"""pytest's set-up for the whole checkout: the tests under tests/ and the
doctests of the package's modules (``make test`` runs both).

The pytest process stays on the CPU (JAX_PLATFORMS=cpu), also on a GPU
machine: the GPU tests run in worker processes of their own (tests/gpu/),
which must find the GPUs' memory free. 8 simulated CPU devices. Both must be
set before jax is imported.

On the CPU, the process compiles its programs with LLVM's optimizations off
and with XLA's loop emitters for fusions instead of its MLIR fusion emitters
(CPU_TEST_FLAGS): the tests compile hundreds of small programs and run each a
few times, so compiling took most of the suite's time. Both flags change how
the CPU code is generated, not the collectives of the compiled HLO (what the
tests count), and compute the same numbers up to rounding. XLA
reads XLA_FLAGS once, when the backend starts: the flags are set for that
moment only, so the processes that the tests start (the GPU workers above
all) do not inherit them; a test that starts a CPU process passes
CPU_TEST_FLAGS itself.
"""

import os

import pytest

CPU_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

if os.environ["JAX_PLATFORMS"] == "cpu":
  _inherited = os.environ["XLA_FLAGS"]
  os.environ["XLA_FLAGS"] = f"{_inherited} {CPU_TEST_FLAGS}"
  import jax  # noqa: E402

  try:
    jax.devices()  # the backend starts here, and XLA reads its flags
  finally:
    os.environ["XLA_FLAGS"] = _inherited


def pytest_collection_modifyitems(config, items):
  """Under pytest-xdist (make test: -n 2 --dist loadgroup), the GPU tests all
  run in one worker, one at a time: two of them at once would share the GPUs."""
  if not config.pluginmanager.hasplugin("xdist"):
    return
  for item in items:
    if item.get_closest_marker("gpu") is not None:
      item.add_marker(pytest.mark.xdist_group("gpu"))
