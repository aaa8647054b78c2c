"""GPU tests: the cuBLASMp backend on real GPUs, in worker processes that
pytest launches itself.

Two jobs run once per session: one process per GPU (jax.distributed on
127.0.0.1, all checks; every GPU of the machine, or JCG_GPU_PROCESSES) and one
process driving every GPU (a subset). Each test below reports one check of one
job. Without two GPUs or without the built extension they skip, saying why.
Set JCG_GPU_LOG_DIR to keep the workers' logs. With JCG_GPU_SHARED=N (the
default on a machine with one GPU: 2) the one-process-per-GPU job runs N ranks
on one GPU (tests/gpu/machine.py); checks that need distinct GPUs skip there,
naming the library's refusal. A check passes only where every rank passed it,
and is skipped only where every rank skipped it for the same reason.
"""

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.gpu import checks
from tests.gpu.outcome import PASSED, SKIPPED, outcome
from tests.gpu.machine import (free_port, processes, rank_environment, shared_ranks,
                               skip_reason)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1500)]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
JOB_TIMEOUT_S = float(os.environ.get("JCG_GPU_JOB_TIMEOUT_S", "600"))
# JCG_GPU_CHECKS="a*,b" runs only the checks matching those patterns (a long
# suite split over several runs); the others are reported as not selected.
SELECTED = [c for c in checks.CHECKS
            if any(fnmatch.fnmatchcase(c, pattern)
                   for pattern in os.environ.get("JCG_GPU_CHECKS", "*").split(","))]


def _worker_env(process_id: int | None = None) -> dict:
  """The environment of a worker process; of rank `process_id` of a job."""
  env = dict(os.environ, **({} if process_id is None else rank_environment(process_id)))
  env.pop("JAX_PLATFORMS", None)  # the pytest process is pinned to CPU, workers are not
  # The workers' stacks are dumped shortly before the job is killed.
  env.setdefault("JCG_HANG_DUMP_S", str(max(30, int(JOB_TIMEOUT_S) - 15)))
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


def _run_job(name: str, num_processes: int, check_names) -> dict:
  """Runs one job; returns {check: [result of each process]}."""
  port = free_port()
  log_dir = os.environ.get("JCG_GPU_LOG_DIR") or tempfile.mkdtemp(prefix="jcg_gpu_")
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = [], []
  for pid in range(num_processes):
    cmd = [sys.executable, WORKER, "--checks", ",".join(check_names)]
    if num_processes > 1:
      cmd += ["--process-id", str(pid), "--num-processes", str(num_processes),
              "--port", str(port)]
    # Written as it goes, so that a hang still leaves the log behind.
    logs.append(os.path.join(log_dir, f"{name}_process{pid}.log"))
    with open(logs[-1], "w") as log:
      procs.append(subprocess.Popen(cmd, env=_worker_env(pid), stdout=log,
                                    stderr=subprocess.STDOUT))
  deadline = time.monotonic() + JOB_TIMEOUT_S
  for p in procs:
    try:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
  outputs = []
  for path in logs:
    with open(path) as f:
      outputs.append(f.read())
  results = {}
  for pid, text in enumerate(outputs):
    per_check = {}
    for line in text.splitlines():  # one line per check, written as each ends
      if line.startswith("JCG_CHECK "):
        result = json.loads(line[len("JCG_CHECK "):])
        per_check[result.pop("name")] = result
    for check in check_names:
      results.setdefault(check, []).append(per_check.get(
          check, {"ok": False, "error": f"process {pid} reported nothing for {check} (it hung "
                                        f"or the process ended before):\n{text[-3000:]}"}))
  return results


@pytest.fixture(scope="session")
def multi_process_results():
  reason = skip_reason()
  if reason:
    pytest.skip(reason)
  return _run_job("multi_process", processes(), SELECTED)


@pytest.fixture(scope="session")
def single_process_results():
  reason = skip_reason()
  if reason:
    pytest.skip(reason)
  if shared_ranks():
    pytest.skip("the shared-GPU mode has one GPU: one process driving it is a group of one")
  return _run_job("single_process", 1,
                  [c for c in checks.SINGLE_PROCESS_CHECKS if c in SELECTED])


def _assert_ok(per_process):
  """Fails where any rank failed or the ranks disagree; skips only where every
  rank skipped for the same reason (tests/gpu/outcome.py)."""
  status, why = outcome(per_process)
  if status == SKIPPED:
    pytest.skip(why)
  assert status == PASSED, why


def _selected(check):
  if check not in SELECTED:
    pytest.skip(f"{check} not selected by JCG_GPU_CHECKS")


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_one_process_per_gpu(check, multi_process_results):
  _selected(check)
  _assert_ok(multi_process_results[check])


@pytest.mark.parametrize("check", checks.SINGLE_PROCESS_CHECKS)
def test_one_process_all_gpus(check, single_process_results):
  _selected(check)
  _assert_ok(single_process_results[check])


def test_autotune_step_takes_the_same_decision_on_every_rank(multi_process_results):
  _selected("autotune_step")
  per_process = multi_process_results["autotune_step"]
  _assert_ok(per_process)
  decisions = [(r["details"]["plan"], r["details"]["why"]) for r in per_process]
  assert all(d == decisions[0] for d in decisions), decisions


def test_autotune_takes_the_same_choice_on_every_rank(multi_process_results):
  """Process 0 decides and publishes; the others must have recorded the same."""
  _selected("autotune")
  per_process = multi_process_results["autotune"]
  _assert_ok(per_process)
  choices = [r["details"]["choices"] for r in per_process]
  assert all(c == choices[0] for c in choices), choices
