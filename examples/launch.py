"""Several processes of one script on this machine, joined by jax.distributed
on 127.0.0.1: one per GPU, or on the CPU the 8 simulated devices shared among
them (XLA's CPU collectives then go through gloo)."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
from jax.experimental import multihost_utils

import jax_comm_gemm as jcg

CPU_DEVICES = 8
# Seconds the processes get to end after SIGTERM before SIGKILL: jax.distributed's
# preemption notifier takes SIGTERM and keeps a process running.
GRACE_S = 10.0


def gpu_count() -> int:
  """GPUs that nvidia-smi lists (asked without starting jax's GPU backend,
  which would take the GPUs' memory from the processes)."""
  if shutil.which("nvidia-smi") is None:
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def _on_cpu() -> bool:
  return os.environ.get("JAX_PLATFORMS", "").lower() == "cpu"


def shared_gpu_environment(process_id: int, n: int, env=os.environ) -> dict:
  """What process `process_id` of `n` sharing GPU 0 needs in its environment:
  a host id of its own, so that NCCL takes it for another host, and memory
  taken as it is needed, at most 0.8/n of the GPU. A pool taken up front left
  too little outside it at 4 processes for the CUDA contexts, NCCL's buffers
  and the modules of every program autotune loads (out of memory at 0.2 each,
  docs/gpu-testing.md). An explicit setting in `env` stays."""
  return {"NCCL_HOSTID": f"jcg-shared-rank-{process_id}",
          "XLA_PYTHON_CLIENT_PREALLOCATE": env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
          "XLA_PYTHON_CLIENT_MEM_FRACTION": env.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                    f"{0.8 / n:.3f}")}


def run_processes(n: int, script: str, argv: list[str], share_gpu: bool = False) -> int:
  """Runs ``script argv`` in `n` processes and waits for them; returns the
  first failure's exit code, else 0. Only process 0 prints its progress.

  With `share_gpu` the processes all drive GPU 0: NCCL counts each as a host
  of its own (NCCL_HOSTID) and joins them through its network transport, and
  each takes a share of the GPU's memory. That checks a multi-process run on
  one GPU; it measures no speed, and NCCL has no symmetric memory there."""
  on_cpu = _on_cpu() or gpu_count() == 0
  if not on_cpu and not share_gpu and gpu_count() < n:
    print(f"error: --processes {n} needs {n} GPUs, nvidia-smi lists {gpu_count()} "
          f"(--share-gpu runs them all on GPU 0)", file=sys.stderr)
    return 2
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(n):
    env = dict(os.environ)
    if on_cpu:
      flags = [f for f in env.get("XLA_FLAGS", "").split()
               if "xla_force_host_platform_device_count" not in f]
      count = max(1, CPU_DEVICES // n)
      env.update(JAX_PLATFORMS="cpu",
                 XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={count}"]))
    elif share_gpu:
      env.update(shared_gpu_environment(i, n, env))
    procs.append(subprocess.Popen([sys.executable, script, *argv, "--process-id", str(i),
                                   "--port", str(port)], env=env))
  # A launcher ended by a signal (a `timeout`, Ctrl-C) ends its processes
  # too: left running, they would hold the GPU's memory.
  previous = signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.returncode not in (None, 0)]
      if failed:  # the others would wait for the failed one until their timeout
        return failed[0].returncode
      time.sleep(0.2)
    return next((p.returncode for p in procs if p.returncode), 0)
  finally:
    stop(procs)
    signal.signal(signal.SIGTERM, previous)


def stop(procs) -> None:
  """Ends those of `procs` still running: SIGTERM, then SIGKILL for any that
  is still there GRACE_S later."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + GRACE_S
  for p in procs:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def join(process_id: int, n: int, port: int, share_gpu: bool = False) -> None:
  """jax.distributed for a process that run_processes started (`share_gpu`:
  as it was started)."""
  if _on_cpu():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=process_id,
                             local_device_ids=None if _on_cpu() else [0 if share_gpu else process_id],
                             initialization_timeout=300)


def leave() -> None:
  """Ends a process that join() started, without error lines: every process
  waits for the others, releases the cuBLASMp contexts (collective) while all
  are there, drops jax's backends (and with them the programs compiled for
  them), and only then stops jax.distributed. A PjRt client still alive when
  its coordination agent stops logs "WatchTasksAsync failed ... CANCELLED",
  then "UNAVAILABLE" once the leader's service is gone (seen with jax 0.11.2
  on GPUs)."""
  multihost_utils.sync_global_devices("jax_comm_gemm leave")
  jcg.runtime.REGISTRY.shutdown()
  jax.extend.backend.clear_backends()
  gc.collect()
  jax.distributed.shutdown()
