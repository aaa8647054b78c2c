"""What the GPU test modules ask of the machine before they launch workers:
whether it can run them at all, how many ranks, on which GPUs, and a free
port for jax.distributed.

The shared-GPU mode runs several ranks on one GPU: one process per rank, each
counted by NCCL as a host of its own (``NCCL_HOSTID``), with a share of the
GPU's memory; NCCL then joins them through its network transport. It proves
the protocol, agreement, numerics and failures at any group size, not speed,
and not what needs NCCL symmetric memory (docs/gpu-testing.md). Ask for it
with ``JCG_GPU_SHARED=N`` (N ranks); on a machine with one GPU it is the
default, with 2 ranks.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess

SHARED = "JCG_GPU_SHARED"


def gpu_count() -> int:
  if shutil.which("nvidia-smi") is None:
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def shared_ranks() -> int:
  """Ranks sharing GPU 0 (the shared-GPU mode), or 0 for one process per GPU."""
  value = os.environ.get(SHARED, "")
  if value:
    ranks = int(value)
    if ranks < 2:
      raise ValueError(f"{SHARED}={value!r}: the shared-GPU mode needs 2 ranks or more")
    return ranks
  return 2 if gpu_count() == 1 else 0


def processes() -> int:
  """How many processes the one-process-per-rank job runs: the shared-GPU
  mode's ranks, else every GPU of the machine (or JCG_GPU_PROCESSES)."""
  return shared_ranks() or int(os.environ.get("JCG_GPU_PROCESSES") or gpu_count())


def rank_environment(process_id: int, ranks: int | None = None) -> dict:
  """What a rank's process needs in its environment beyond the parent's; in
  the shared-GPU mode as one of `ranks` (default: the mode's) sharing GPU 0."""
  if not shared_ranks():
    return {}
  ranks = ranks or shared_ranks()
  from examples.launch import shared_gpu_environment  # noqa: PLC0415  (imports jax)
  return {SHARED: str(ranks), **shared_gpu_environment(process_id, ranks)}


def local_device_ids(process_id: int) -> list[int]:
  """The GPU a rank's process drives: its own, or GPU 0 for every rank in
  the shared-GPU mode (read in the rank's process, from rank_environment)."""
  return [0] if os.environ.get(SHARED) else [process_id]


def skip_reason() -> str | None:
  """Why the GPU tests cannot run here, or None."""
  count = gpu_count()
  if count == 0:
    return "needs a GPU (nvidia-smi finds none)"
  if count < 2 and not shared_ranks():
    return "needs 2 GPUs, or JCG_GPU_SHARED=N for N ranks on one GPU"
  if importlib.util.find_spec("jax_comm_gemm._comm_gemm") is None:
    return "the cuBLASMp extension is not built"
  return None


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
