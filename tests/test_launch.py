"""examples/launch.py: a launcher that ends, however it ends, leaves none of
its processes running (they would hold the GPU's memory)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

# A process that takes SIGTERM and keeps running, as jax.distributed's
# preemption notifier makes one; it writes its pid, then waits.
STUBBORN = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: None)
    process_id = sys.argv[sys.argv.index("--process-id") + 1]
    open(os.path.join(sys.argv[1], process_id), "w").write(str(os.getpid()))
    time.sleep(600)
""")

LAUNCHER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import launch
    launch.GRACE_S = 1.0
    sys.exit(launch.run_processes(2, sys.argv[2], [sys.argv[3]]))
""")


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (ended, not yet reaped by its parent) counts as gone.
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_a_terminated_launcher_ends_processes_that_ignore_sigterm(tmp_path):
  child = tmp_path / "stubborn.py"
  child.write_text(STUBBORN)
  pids = tmp_path / "pids"
  pids.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(EXAMPLES), str(child),
                               str(pids)], env=env)
  deadline = time.monotonic() + 60
  while len(list(pids.iterdir())) < 2:
    assert time.monotonic() < deadline, "the processes did not start"
    time.sleep(0.1)
  started = [int(p.read_text()) for p in pids.iterdir()]
  launcher.send_signal(signal.SIGTERM)
  assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
  deadline = time.monotonic() + 10
  while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_alive(pid) for pid in started), "a process outlived its launcher"


def test_processes_sharing_a_gpu_take_their_memory_as_they_need_it():
  """Each process is a host of its own to NCCL and takes memory as it needs it,
  capped at its share: a pool taken up front starved what lives outside it."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    import launch  # noqa: PLC0415
  finally:
    sys.path.remove(str(EXAMPLES))
  envs = [launch.shared_gpu_environment(i, 4, {}) for i in range(4)]
  assert len({e["NCCL_HOSTID"] for e in envs}) == 4
  assert all(e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" for e in envs)
  assert all(e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.200" for e in envs)
  mine = launch.shared_gpu_environment(0, 4, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1",
                                              "XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
  assert mine["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1"
  assert mine["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
