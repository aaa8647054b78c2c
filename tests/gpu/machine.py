"""What both GPU test modules ask of the machine before they launch workers:
whether it can run them at all, and a free port for jax.distributed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess


def gpu_count() -> int:
  if shutil.which("nvidia-smi") is None:
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def processes() -> int:
  """How many processes the one-process-per-GPU job runs: every GPU of the
  machine (tensor parallelism over all of them), or JCG_GPU_PROCESSES."""
  return int(os.environ.get("JCG_GPU_PROCESSES") or gpu_count())


def skip_reason() -> str | None:
  """Why the GPU tests cannot run here, or None."""
  if gpu_count() < 2:
    return "needs 2 GPUs (nvidia-smi finds fewer)"
  if importlib.util.find_spec("jax_comm_gemm._comm_gemm") is None:
    return "the cuBLASMp extension is not built"
  return None


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
