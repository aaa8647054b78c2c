"""The one-GPU checks (tests/gpu/one_gpu.py) in a process of their own: the FP8
GEMM custom call and the FP8 layers on it. They skip without a GPU or without
the built extension."""

import os
import subprocess
import sys

import pytest

from tests.gpu.machine import gpu_count
from tests.gpu.test_gpu_suite import _worker_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_gpu.py")


def test_one_gpu_checks():
  if gpu_count() < 1:
    pytest.skip("needs a GPU (nvidia-smi finds none)")
  import importlib.util
  if importlib.util.find_spec("jax_comm_gemm._comm_gemm") is None:
    pytest.skip("the cuBLASMp extension is not built")
  run = subprocess.run([sys.executable, SCRIPT], env=_worker_env(), capture_output=True,
                       text=True, timeout=800)
  print(run.stdout[-6000:], run.stderr[-3000:])
  assert run.returncode == 0, run.stdout[-6000:]
