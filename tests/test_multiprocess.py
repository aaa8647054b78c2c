"""Two CPU processes joined by ``jax.distributed`` (see ``mp_worker.py``).

Each process has 2 simulated CPU devices; the layers run over meshes of all 4,
with tensor-parallel groups that span both processes, and every process checks
its own shards against a reference it computes locally. ``connect`` (with a
stand-in for the extension) must hand the leader's NCCL-id bytes to the other
process through the key-value store, one process must lower a GPU program
alone, and a disagreement between the processes must raise in both.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import jax_comm_gemm
from conftest import CPU_TEST_FLAGS

TESTS = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jax_comm_gemm.__file__)))
TIMEOUT_S = 120


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(process_id: int, port: int, *args, worker: str = "mp_worker.py",
            **settings) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMM_GEMM_")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {CPU_TEST_FLAGS}", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p), **settings)
  return subprocess.Popen([sys.executable, os.path.join(TESTS, worker),
                           str(process_id), str(port), *args],
                          cwd=TESTS, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _run_both(procs, timeout_s: float) -> list:
  deadline = time.monotonic() + timeout_s
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
  except subprocess.TimeoutExpired:
    pytest.fail(f"the worker processes did not finish within {timeout_s} s")
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  return [_result(i, proc, *out) for i, (proc, out) in enumerate(zip(procs, outputs))]


def _result(process_id: int, proc: subprocess.Popen, stdout: str, stderr: str) -> dict:
  lines = [line for line in stdout.splitlines() if line.startswith("{")]
  assert lines, (f"process {process_id} (exit {proc.returncode}) printed no result\n"
                 f"stdout:\n{stdout}\nstderr:\n{stderr[-4000:]}")
  result = json.loads(lines[-1])
  assert result["ok"], f"process {process_id} failed:\n{result.get('error')}"
  assert proc.returncode == 0, f"process {process_id} exited with {proc.returncode}"
  return result


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_processes():
  """sharded.mlp / column / row layers forward+grad over 4 devices in 2
  processes agree with the reference on every process's shards, and both
  processes end with the leader's unique id."""
  port = _free_port()
  results = _run_both([_launch(i, port) for i in range(2)], TIMEOUT_S)
  for result in results:
    # 4 layers checked (2 MLP routings, column, row), each output and gradient.
    assert len(result["checks"]) == 2 * 6 + 2 * 4 + 2 + (result["process"] == 0), \
        result["checks"]
  assert results[0]["unique_id"] == results[1]["unique_id"]
  assert len(bytes.fromhex(results[0]["unique_id"])) == 128


@pytest.mark.timeout(90)
def test_processes_that_disagree_on_a_setting_fail_at_connect_on_cpu():
  """Two CPU processes with different JAX_COMM_GEMM_BACKEND values: connect
  raises a DisagreementError in both, naming the setting and the processes,
  before any collective (before, they stalled 30 s and failed in jax's Gloo
  set-up)."""
  port = _free_port()
  start = time.monotonic()
  results = _run_both([_launch(i, port, "disagree", JAX_COMM_GEMM_BACKEND=backend)
                       for i, backend in enumerate(("xla", "ring"))], 60)
  for result in results:
    assert ("JAX_COMM_GEMM_BACKEND differs (process 0: 'xla'; process 1: 'ring')"
            in result["message"]), result["message"]
  assert time.monotonic() - start < 30


# In process 1 alone: the ring fails to build, pipelined_ce computes a wrong
# result, cublasmp_default raises in its second timed batch (mp_autotune_worker.py).
PLANTS = {"build": "ring", "check": "pipelined_ce", "time": "cublasmp_default"}


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_autotune_with_candidates_failing_in_one_process_ends_alike_in_both():
  """autotune_step (each op's autotune, then the step under each plan) over a
  tensor-parallel axis spanning both processes, with a candidate that fails
  to build, one that is wrong and one that fails while timed, each in process
  1 only: every process learns of each failure before its next collective,
  so both finish, in bounded time (they stopped in time_candidates until
  killed when a failure while timed was left to the process that saw it),
  with the same choices, none of them a failed candidate, each failure named
  with its process and message."""
  port = _free_port()
  plants = ",".join(f"{phase}={name}" for phase, name in PLANTS.items())
  results = _run_both([_launch(i, port, plants, worker="mp_autotune_worker.py")
                       for i in range(2)], TIMEOUT_S)
  assert results[0]["choices"] == results[1]["choices"]
  assert results[0]["step"] == results[1]["step"]
  choices, (plan, why) = results[0]["choices"], results[0]["step"]
  assert len(choices) >= 4, choices  # forward and backward, AllGather+GEMM and GEMM+RS
  expected = {"ring": r"process 1: planted: ring cannot be built here",
              "pipelined_ce": r"process 1: wrong result: differs from XLA's",
              "cublasmp_default": r"process 1: planted: cublasmp_default failed while timed"}
  for choice, reason in [*choices.values(), (plan, why)]:
    assert choice not in PLANTS.values(), (choice, reason)
    for name, failure in expected.items():
      assert re.search(rf"{name} \({failure}", reason), (name, reason)
