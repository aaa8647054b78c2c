"""GPU failure tests (issue 8): ranks that disagree, die or fail alone must
end in errors within bounded time, never in hangs or silently wrong numbers;
and the 500-run stress check.

Each job below runs tests/gpu/failures.py in one process per GPU or in one
process for both GPUs, with a hard timeout after which every process of the
job is killed; the logs are kept (JCG_GPU_LOG_DIR, else a temporary folder),
and stress.log / failures_summary.log there collect the stress counts and what
the kill scenario found. Without two GPUs or without the built extension the
tests skip, saying why.

Knobs: JCG_STRESS_RUNS (default 500), JCG_FAILURE_JOB_SCALE (multiplies every
job's timeout).

Longer than 300 lines because each scenario's launch, time limits and assertions sit beside each other.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

from tests.gpu import checks
from tests.gpu.machine import (free_port, gpu_count, rank_environment, shared_ranks,
                               skip_reason)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "failures.py")
RESULT_PREFIX = "JCG_RESULT "
KILL_MARKER = "JCG_KILL_ME"
CALL_TIMEOUT, CONNECT_TIMEOUT = "JAX_COMM_GEMM_TIMEOUT", "JAX_COMM_GEMM_CONNECT_TIMEOUT"
KILL_DEADLINE_S = 10      # JAX_COMM_GEMM_TIMEOUT of the kill job
SHORT_DEADLINE_S = 5      # JAX_COMM_GEMM_TIMEOUT of the one-rank and cached-shape jobs
MARGIN_S = 15             # watchdog poll, abort grace (5 s), scheduling
SENTINEL_GRACE_S = 3      # JAX_COMM_GEMM_ABORT_GRACE of the kill_sentinel job
ABORT_GRACE = "JAX_COMM_GEMM_ABORT_GRACE"
JAX_OWN_ABORT_S = 65      # measured: jax's coordination service aborts the survivor
STRESS_RUNS = int(os.environ.get("JCG_STRESS_RUNS", "500"))
TOLD_VICTIM, TOLD_WITHIN_S, TOLD_GRACE_S = 2, 15, 5
PLANT_SO = os.path.join(tempfile.gettempdir(), "jcg_plant_alloc_failure.so")
# Windows of 100 MB or more: the scenario's first call (32 MiB) passes, its second fails.
PLANTED = {"LD_PRELOAD": PLANT_SO + ":" + os.environ.get("LD_PRELOAD", ""),
           "JCG_PLANT_ALLOC_FAIL_FROM": str(100_000_000)}
SCALE = float(os.environ.get("JCG_FAILURE_JOB_SCALE", "1"))

# name: (processes, scenarios, environment of each process, timeout s, extra args)
JOBS = {
    "disagree": (2, "disagree", [{CALL_TIMEOUT: "60"}, {CALL_TIMEOUT: "90"}], 90, []),
    "multi_default": (2, "shapes,stress", [{CALL_TIMEOUT: "60"}] * 2, 240,
                      ["--runs", str(STRESS_RUNS)]),
    "kill": (2, "kill", [{CALL_TIMEOUT: str(KILL_DEADLINE_S)}] * 2, 180, []),
    # The same, with the library's sentinel and no poller of the test's own.
    "kill_sentinel": (2, "kill", [{CALL_TIMEOUT: str(KILL_DEADLINE_S),
                                   ABORT_GRACE: str(SENTINEL_GRACE_S),
                                   "JCG_NO_ERROR_WATCH": "1"}] * 2, 180, []),
    # A short grace: the failing rank's follow-up call may be left in a GPU
    # wait on the peer that gave up, which only the sentinel ends.
    "one_rank": (2, "one_rank", [{CALL_TIMEOUT: str(SHORT_DEADLINE_S),
                                  ABORT_GRACE: str(SENTINEL_GRACE_S)}] * 2, 150, []),
    "shapes_cached": (2, "shapes_cached", [{CALL_TIMEOUT: str(SHORT_DEADLINE_S)}] * 2, 150, []),
    # One rank of four fails to allocate (a planted failure): the others must end
    # within TOLD_WITHIN_S with its reason, the call timeout (300 s) far away.
    "told": (4, "told", [{CALL_TIMEOUT: "300", ABORT_GRACE: str(TOLD_GRACE_S),
                          **(PLANTED if pid == TOLD_VICTIM else {})} for pid in range(4)],
             180, []),
    "single_default": (1, "stress,poll_growth", [{}], 240, ["--runs", str(STRESS_RUNS)]),
}


_LOG_DIR = []


def _log_dir() -> str:
  if not _LOG_DIR:
    path = os.environ.get("JCG_GPU_LOG_DIR") or tempfile.mkdtemp(prefix="jcg_failures_")
    os.makedirs(path, exist_ok=True)
    _LOG_DIR.append(path)
  return _LOG_DIR[0]


def _summary(line: str, name: str = "failures_summary.log") -> None:
  with open(os.path.join(_log_dir(), name), "a") as f:
    f.write(line.rstrip() + "\n")


def _worker_env(overrides: dict, timeout_s: float, process_id: int, nproc: int) -> dict:
  env = dict(os.environ, **rank_environment(process_id, nproc))
  env.pop("JAX_PLATFORMS", None)  # the pytest process is pinned to CPU, workers are not
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  if not env["XLA_FLAGS"]:
    del env["XLA_FLAGS"]  # set but blank makes XLA abort
  for name in [n for n in env if n.startswith("JAX_COMM_GEMM_")]:
    env.pop(name)  # each job sets what it tests; an unknown name would fail connect
  env[CONNECT_TIMEOUT] = "60"
  env["PYTHONUNBUFFERED"] = "1"
  env["JCG_HANG_DUMP_S"] = str(max(20, int(timeout_s) - 10))  # stacks before the kill
  env["PYTHONPATH"] = os.pathsep.join(
      [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env.update(overrides)
  return env


def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _kill(proc) -> None:
  """SIGKILL to a worker we started (by its pid; workers start no children).
  They stay in pytest's process group, so a `timeout` around pytest ends them
  too."""
  try:
    proc.kill()
  except ProcessLookupError:
    pass


def _run_job(name: str) -> dict:
  """Runs job `name` of JOBS: {"processes": [...], "t_kill": ...}; each process
  has rc, t_launch, t_end (time.time(), seen every 0.1 s), log, results."""
  nproc, scenarios, envs, timeout_s, extra = JOBS[name]
  timeout_s *= SCALE
  port = free_port()
  procs = []
  for pid in range(nproc):
    cmd = [sys.executable, WORKER, "--scenarios", scenarios, *extra]
    if nproc > 1:
      cmd += ["--process-id", str(pid), "--num-processes", str(nproc), "--port", str(port)]
    path = os.path.join(_log_dir(), f"failures_{name}_process{pid}.log")
    with open(path, "w") as log:
      p = subprocess.Popen(cmd, env=_worker_env(envs[pid], timeout_s, pid, nproc), stdout=log,
                           stderr=subprocess.STDOUT)
    procs.append({"proc": p, "log": path, "t_launch": time.time(), "t_end": None})
  job = {"name": name, "t_kill": None, "timed_out": []}
  deadline = time.time() + timeout_s
  victim = procs[1] if name.startswith("kill") else None
  while any(p["t_end"] is None for p in procs) and time.time() < deadline:
    for p in procs:
      if p["t_end"] is None and p["proc"].poll() is not None:
        p["t_end"] = time.time()
    if victim is not None and job["t_kill"] is None and victim["t_end"] is None \
        and KILL_MARKER in _read(victim["log"]):
      time.sleep(0.2)  # into the next steps
      victim["proc"].send_signal(signal.SIGKILL)
      job["t_kill"] = time.time()
      # The survivor has until well before jax's own abort, plus its exit.
      deadline = min(deadline, job["t_kill"] + JAX_OWN_ABORT_S + 15)
    time.sleep(0.1)
  for i, p in enumerate(procs):
    if p["t_end"] is None:
      job["timed_out"].append(i)
      _kill(p["proc"])
    p["proc"].wait()
    if p["t_end"] is None:
      p["t_end"] = time.time()
  job["processes"] = []
  for p in procs:
    text = _read(p["log"])
    results = {}
    for line in text.splitlines():
      if line.startswith(RESULT_PREFIX):
        r = json.loads(line[len(RESULT_PREFIX):])
        results.setdefault(r["scenario"], r)  # the first word on a scenario stands
    job["processes"].append({"rc": p["proc"].returncode, "t_launch": p["t_launch"],
                             "t_end": p["t_end"], "log": p["log"], "results": results,
                             "tail": text[-4000:]})
  _summary(f"job {name}: rc={[p['rc'] for p in job['processes']]} "
           f"seconds={[round(p['t_end'] - p['t_launch'], 1) for p in job['processes']]}"
           f"{' timed out: ' + str(job['timed_out']) if job['timed_out'] else ''}")
  return job


_JOB_CACHE = {}


def _job(name: str) -> dict:
  reason = skip_reason()
  if reason:
    pytest.skip(reason)
  if shared_ranks() and JOBS[name][0] == 1:
    pytest.skip("the shared-GPU mode has one GPU: one process driving it is a group of one")
  if not shared_ranks() and JOBS[name][0] > gpu_count():
    pytest.skip(f"needs {JOBS[name][0]} GPUs, or the shared-GPU mode (JCG_GPU_SHARED)")
  if name not in _JOB_CACHE:
    _JOB_CACHE[name] = _run_job(name)
  return _JOB_CACHE[name]


def _result(job: dict, pid: int, scenario: str) -> dict:
  p = job["processes"][pid]
  r = p["results"].get(scenario)
  assert r is not None, (f"{job['name']}: process {pid} (rc {p['rc']}) reported nothing for "
                         f"{scenario}; log {p['log']}:\n{p['tail']}")
  return r


def _why(job: dict, pid: int, r: dict) -> str:
  p = job["processes"][pid]
  return (f"{job['name']} process {pid} (rc {p['rc']}, log {p['log']}): "
          f"{json.dumps(r, default=str)[:3000]}")


# --- the tests ---------------------------------------------------------------------

def test_mismatched_setting_is_an_error_on_both():
  job = _job("disagree")
  messages = []
  for pid in range(2):
    r, p = _result(job, pid, "disagree"), job["processes"][pid]
    why = _why(job, pid, r)
    assert r["raised"] == "DisagreementError" and r["is_disagreement"], why
    for part in ("JAX_COMM_GEMM_TIMEOUT differs", "'60'", "'90'", "process 0", "process 1"):
      assert part in r["message"], f"{part!r} missing: {why}"
    assert r["t_error"] - p["t_launch"] < 30, f"error after {r['t_error'] - p['t_launch']:.1f} s: {why}"
    assert r["contexts"] == [], f"contexts made despite the disagreement: {why}"
    assert p["rc"] == 0, f"did not exit cleanly: {why}\n{p['tail']}"
    assert p["t_end"] - p["t_launch"] < 45, why
    messages.append(r["message"])
  assert messages[0] == messages[1], messages


def test_mismatched_shapes_is_an_error_on_both_and_leaves_the_group_usable():
  job = _job("multi_default")
  for pid in range(2):
    r = _result(job, pid, "shapes")
    why = _why(job, pid, r)
    error = r["mismatch_error"] or ""
    for part in ("plan mismatch in the group", "x rows", "rank 0 has 512", "rank 1 has 768"):
      assert part in error, f"{part!r} missing: {why}"
    assert r["mismatch_seconds"] < 30, why
    assert all(c["error"] == "" for c in r["contexts_after_mismatch"]), why
    assert r["after_errors"] == [None, None], why
    assert r["after_rel_err"] < checks.TOLERANCE["bf16"], why
    assert r["after_bit_equal"], why
    assert r["ok"], why


def test_cached_plan_against_new_shape_is_never_silently_wrong_nor_a_hang():
  """Rank 0 repeats a plan both agreed on (no agreement on its side), rank 1
  calls a new token count: each must error within the deadline, or compute
  right numbers; a hang is ended by the watchdog."""
  job = _job("shapes_cached")
  notes = []
  for pid in range(2):
    r = _result(job, pid, "shapes_cached")
    why = _why(job, pid, r)
    assert not r.get("hung"), f"hung: {why}"
    assert not r.get("silently_wrong"), f"wrong numbers without an error: {why}"
    if r.get("exit_path") == "poller":
      notes.append(f"process {pid}: main thread blocked after the context error "
                   f"({r['context_error'][:200]})")
    elif r.get("wrong_numbers_then_aborted"):
      notes.append(f"process {pid}: wrong numbers, but the watchdog aborted the context "
                   f"(the next call fails): {r['context_error'][:200]}")
    else:
      assert r["error"] is not None or r["rel_err"] < checks.TOLERANCE["bf16"], why
      if r["error"] is not None:
        assert r["seconds"] <= SHORT_DEADLINE_S + MARGIN_S, why
      notes.append(f"process {pid}: {r['exit_path']}: {(r['error'] or 'right numbers')[:300]}")
  _summary("shapes_cached: " + " | ".join(notes))
  warnings.warn("shapes_cached: " + " | ".join(notes))  # what happened, in pytest's summary


def test_kill_one_process_survivor_errors_within_the_deadline():
  job = _job("kill")
  survivor, victim = job["processes"]
  assert job["t_kill"] is not None, (f"the victim never asked to be killed:\n{victim['tail']}\n"
                                     f"survivor:\n{survivor['tail']}")
  assert victim["rc"] == -signal.SIGKILL, victim["rc"]
  r = _result(job, 0, "kill")
  why = _why(job, 0, r)
  t_kill = job["t_kill"]
  seen = [t for t in (r.get("t_error_seen"),
                      r.get("t_exception") if r.get("exception_is_project") else None) if t]
  assert seen, f"no error from the project: {why}"
  latency = min(seen) - t_kill
  text = (r.get("context_error") or "") + (r.get("exception") or "")
  assert "did not answer within" in text or "NCCL reported" in text or "aborted" in text, why
  assert latency <= KILL_DEADLINE_S + MARGIN_S, f"error {latency:.1f} s after the kill: {why}"
  exit_after = survivor["t_end"] - t_kill
  assert survivor["rc"] in (0, 3), f"rc {survivor['rc']}: {why}\n{survivor['tail']}"
  assert exit_after < JAX_OWN_ABORT_S - 10, f"exited {exit_after:.1f} s after the kill: {why}"
  line = (f"kill: exit path {r.get('exit_path')} (rc {survivor['rc']}); error "
          f"{latency:.1f} s and exit {exit_after:.1f} s after the SIGKILL; main thread was in "
          f"{r.get('main_phase_at_error')!r} when the error showed, released: "
          f"{r.get('main_released_after_error')}; the abort released a GPU wait on the dead "
          f"peer: {r.get('abort_released_gpu_wait')}; exception raised in "
          f"{r.get('phase_at_exception')!r}; steps {r.get('steps')}; exception: "
          f"{(r.get('exception') or '-')[:300]}; context error: "
          f"{(r.get('context_error') or '-')[:300]}; {r.get('collectives')}; "
          f"initialize kwargs {r.get('distributed_kwargs')}")
  _summary(line)
  warnings.warn(line)  # shown in pytest's summary: which way the survivor got out


def test_kill_one_process_sentinel_ends_the_survivor():
  """Without any poller of the test's own: the library's sentinel ends the
  survivor, whose main thread the abort leaves in a GPU wait, with exit status
  1 and the project's message, JAX_COMM_GEMM_ABORT_GRACE after the abort."""
  job = _job("kill_sentinel")
  survivor, victim = job["processes"]
  assert job["t_kill"] is not None, f"the victim never asked to be killed:\n{victim['tail']}"
  assert victim["rc"] == -signal.SIGKILL, victim["rc"]
  exit_after = survivor["t_end"] - job["t_kill"]
  ended = "jax_comm_gemm: ending the process" in survivor["tail"]
  raised = "kill" in survivor["results"] and survivor["results"]["kill"].get("exception")
  assert ended or raised, f"rc {survivor['rc']}:\n{survivor['tail']}"
  if ended:
    assert survivor["rc"] == 1, survivor["rc"]
  assert exit_after <= KILL_DEADLINE_S + SENTINEL_GRACE_S + MARGIN_S, exit_after
  line = (f"kill_sentinel: survivor rc {survivor['rc']}, out {exit_after:.1f} s after the "
          f"SIGKILL, {'by the sentinel' if ended else 'by an exception'}")
  _summary(line)
  warnings.warn(line)


def test_one_rank_failing_makes_the_peer_fail_not_hang():
  job = _job("one_rank")
  # The failing rank's last word is "one_rank", or, when the sentinel ended it
  # during its follow-up call, what it reported before that call.
  ended = "jax_comm_gemm: ending the process" in job["processes"][1]["tail"]
  peer = _result(job, 0, "one_rank")
  failing = _result(job, 1, "one_rank_before_followup" if ended else "one_rank")
  why0, why1 = _why(job, 0, peer), _why(job, 1, failing)
  assert failing.get("rejected_error") and "unsupported dtype" in failing["rejected_error"], why1
  assert failing["rejected_seconds"] < SHORT_DEADLINE_S, why1
  assert all(c["error"] == "" for c in failing["contexts_after_rejection"]), why1
  assert peer.get("peer_error"), f"the peer's call did not fail: {why0}"
  assert "jax_comm_gemm" in peer["peer_error"], why0
  assert "did not answer within" in peer["peer_error"] or "aborted" in peer["peer_error"], why0
  assert peer["peer_seconds"] <= SHORT_DEADLINE_S + MARGIN_S, why0
  assert failing.get("peer_done") is True, why1
  # The failing rank's next call either fails, or (its kernels left waiting on
  # the peer that gave up, which no abort releases) the sentinel ends it.
  if ended:
    assert job["processes"][1]["rc"] == 1, why1
  else:
    assert failing.get("followup_error"), f"a call after the peer gave up did not fail: {why1}"
    assert failing["followup_seconds"] <= SHORT_DEADLINE_S + MARGIN_S, why1
  for pid in range(2 if not ended else 1):
    p = job["processes"][pid]
    assert p["rc"] == 0, f"process {pid} rc {p['rc']}:\n{p['tail']}"
  line = (f"one_rank: peer error in {peer['peer_seconds']:.1f} s; the failing rank "
          f"{'ended by the sentinel' if ended else 'got an error on its next call'}")
  _summary(line)
  warnings.warn(line)


def test_a_rank_that_fails_alone_ends_every_rank_with_its_reason():
  """The victim's planted allocation failure aborts its context for its own
  reason; every other rank's call ends (an error, or the sentinel) within
  TOLD_WITHIN_S of it, saying "rank 2 failed: " and the victim's reason."""
  built = subprocess.run(["cc", "-shared", "-fPIC", "-o", PLANT_SO,
                          os.path.join(HERE, "plant_alloc_failure.c"), "-ldl"],
                         capture_output=True, text=True)
  assert built.returncode == 0, built.stderr
  job = _job("told")
  victim = _result(job, TOLD_VICTIM, "told")
  why = _why(job, TOLD_VICTIM, victim)
  assert victim["planted"] and not victim["warmup_error"], why
  assert victim["error"] and "ncclMemAlloc" in victim["error"], why
  failed_at = victim["t_end"]
  lines = [f"told: rank {TOLD_VICTIM} failed: {victim['error'][:160]}"]
  for pid, p in enumerate(job["processes"]):
    if pid == TOLD_VICTIM:
      continue
    r = p["results"].get("told")
    said = (r or {}).get("error") or p["tail"]
    ended = r["t_end"] if r else p["t_end"]
    assert f"rank {TOLD_VICTIM} failed: " in said and "ncclMemAlloc" in said, (
        f"process {pid}: {said[-2000:]}")
    assert ended - failed_at <= TOLD_WITHIN_S, f"process {pid} ended {ended - failed_at:.1f} s after"
    lines.append(f"process {pid}: {'its call failed' if r else 'the sentinel ended it'} "
                 f"{ended - failed_at:.1f} s after the victim's failure")
  _summary("; ".join(lines))
  warnings.warn("; ".join(lines))


def test_polling_contexts_during_workspace_growth_does_not_deadlock():
  job = _job("single_default")
  r = _result(job, 0, "poll_growth")
  why = _why(job, 0, r)
  assert not r.get("hung"), why
  assert r["pollers_stuck"] == 0 and not r["poll_errors"], why
  assert r["polls"] > 100, why
  assert r["distinct_workspace_sizes"] >= 3, f"the workspace did not grow twice: {why}"
  assert r["ok"], why


def _stress_line(mode: str, r: dict) -> str:
  return (f"stress {mode}: {r.get('wrong')} wrong of {r.get('runs')} "
          f"({100 * r.get('rate', 0):.2f}%), per variant {r.get('per_variant')}, host float64 "
          f"checks {r.get('host_checks')} ({r.get('host_checks_wrong')} wrong, "
          f"{len(r.get('host_disagreements') or [])} disagreeing), worst right-run error "
          f"{r.get('worst_error_of_right_runs')}, {r.get('ms_per_run')} ms/run, "
          f"compile {r.get('compile_seconds')} s")


@pytest.mark.parametrize("mode", ["multi_process", "single_process"])
def test_stress_all_right(mode):
  """STRESS_RUNS MLP runs, every one right, under the one ordering there is."""
  job = _job("multi_default" if mode == "multi_process" else "single_default")
  for pid in range(len(job["processes"])):
    r = _result(job, pid, "stress")
    why = _why(job, pid, r)
    assert "runs" in r, why
    _summary(f"process {pid}: " + _stress_line(mode, r), "stress.log")
    assert r["runs"] >= STRESS_RUNS, why
    assert r["wrong"] == 0, f"{r['wrong']} wrong runs: {why}"
    assert r["host_checks"] > 0 and r["host_checks_wrong"] == 0, why
    assert not r["host_disagreements"], why
    assert r["ok"], why
  for pid, p in enumerate(job["processes"]):
    assert p["rc"] == 0, f"process {pid} rc {p['rc']}:\n{p['tail']}"
