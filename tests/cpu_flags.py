"""The XLA flags of the CPU test processes, kept to those the running XLA knows.

The tests compile hundreds of small programs and run each a few times, so
compiling took most of the suite's time. Two flags make that fast:

* ``--xla_backend_optimization_level=0``: LLVM's optimizations off;
* ``--xla_cpu_use_fusion_emitters=false``: XLA's loop emitters for fusions
  instead of its MLIR fusion emitters (newer XLAs have only the latter, and
  refuse the flag).

Both change how the CPU code is generated, not the collectives of the compiled
HLO (what the tests count), and compute the same numbers up to rounding.

XLA ends the process on a flag it does not know (``Unknown flag in
XLA_FLAGS``), before pytest can report anything. So each flag is first tried in
a short child process, and only the accepted ones are used. The answer is kept
in ``JCG_CPU_TEST_FLAGS``: pytest-xdist's workers and the processes the tests
start inherit it and do not ask again.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

WANTED = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_CACHE_VARIABLE = "JCG_CPU_TEST_FLAGS"


def xla_refusal(flags: str) -> str | None:
  """None if a CPU jax process starts with XLA_FLAGS=`flags`, else what XLA said."""
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, text=True, timeout=300)
  if done.returncode == 0:
    return None
  return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]


@functools.cache
def cpu_test_flags() -> str:
  """The flags of WANTED that this XLA accepts, space-separated."""
  cached = os.environ.get(_CACHE_VARIABLE)
  if cached is None:
    if xla_refusal(" ".join(WANTED)) is None:  # the usual case: one child process
      cached = " ".join(WANTED)
    else:
      cached = " ".join(f for f in WANTED if xla_refusal(f) is None)
    os.environ[_CACHE_VARIABLE] = cached
  return cached


def dropped_flags() -> list[str]:
  """The flags of WANTED that this XLA refused."""
  kept = cpu_test_flags().split()
  return [f for f in WANTED if f not in kept]
