"""pytest's set-up for the whole checkout: the tests under tests/ and the
doctests of the package's modules (``make test`` runs both).

The pytest process stays on the CPU (JAX_PLATFORMS=cpu), also on a GPU
machine: the GPU tests run in worker processes of their own (tests/gpu/),
which must find the GPUs' memory free. 8 simulated CPU devices. Both must be
set before jax is imported.

On the CPU, the process compiles with the fast-compile flags of
tests/cpu_flags.py, those of them that the running XLA knows. XLA reads
XLA_FLAGS once, when the backend starts: the flags are set for that moment
only, so the processes that the tests start (the GPU workers above all) do not
inherit them; a test that starts a CPU process passes cpu_test_flags() itself.
"""

import os

import pytest

from tests.cpu_flags import cpu_test_flags, dropped_flags, xla_refusal

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if os.environ.get("XLA_FLAGS", "").strip():
  # XLA ends the process on a flag it does not know; say which, and stop here.
  _refusal = xla_refusal(os.environ["XLA_FLAGS"])
  if _refusal is not None:
    raise pytest.UsageError(f"this XLA refuses XLA_FLAGS={os.environ['XLA_FLAGS']!r}: {_refusal}")

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

if os.environ["JAX_PLATFORMS"] == "cpu":
  _inherited = os.environ["XLA_FLAGS"]
  os.environ["XLA_FLAGS"] = f"{_inherited} {cpu_test_flags()}"
  import jax  # noqa: E402

  try:
    jax.devices()  # the backend starts here, and XLA reads its flags
  finally:
    os.environ["XLA_FLAGS"] = _inherited


def pytest_report_header(config):
  from importlib.metadata import version
  line = (f"jax {version('jax')}, jaxlib {version('jaxlib')}, flax {version('flax')}; "
          f"CPU test flags: {cpu_test_flags() or 'none'}")
  dropped = dropped_flags()
  if dropped:
    line += f" (this XLA does not know {', '.join(dropped)})"
  return line


def pytest_collection_modifyitems(config, items):
  """Under pytest-xdist (make test: -n 2 --dist loadgroup), the GPU tests all
  run in one worker, one at a time: two of them at once would share the GPUs."""
  if not config.pluginmanager.hasplugin("xdist"):
    return
  for item in items:
    if item.get_closest_marker("gpu") is not None:
      item.add_marker(pytest.mark.xdist_group("gpu"))
