"""State shared between threads and jobs: the registry's plan and autotune's
disk cache keep every update made at once."""

import multiprocessing
import threading
import time

import jax_comm_gemm.backends.tuning as tuning
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.runtime.registry import Registry


def _together(count, work):
  """Runs `work(i)` on `count` threads at once; re-raises the first error."""
  errors = []

  def run(i):
    try:
      work(i)
    except BaseException as e:  # noqa: BLE001  (reported below)
      errors.append(e)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=60)
  if errors:
    raise errors[0]


def test_registry_updates_from_threads_are_never_lost(monkeypatch):
  """Threads publishing decisions and connected axes at once: each lands
  (an update built on a plan another thread replaced in between would drop
  that thread's). The pause widens the window a lost update needs."""
  registry = Registry()
  with_decisions, with_axis = plan_lib.Plan.with_decisions, plan_lib.Plan.with_axis

  def slow(real):
    def change(self, *args):
      time.sleep(0.002)
      return real(self, *args)
    return change

  monkeypatch.setattr(plan_lib.Plan, "with_decisions", slow(with_decisions))
  monkeypatch.setattr(plan_lib.Plan, "with_axis", slow(with_axis))

  class Mesh:  # what axis_key reads of a mesh
    axis_names = ("tp",)
    shape = {"tp": 2}

  def work(i):
    for j in range(5):
      registry.record_decisions({("problem", i, j): ("xla", "planted")})
      registry.record(Mesh(), f"axis{i}_{j}", 100 * i + j, (), {})

  _together(6, work)
  plan = registry.plan()
  assert len(plan.decisions) == 30
  assert sorted(comm for _, comm in plan.axes) == sorted(100 * i + j for i in range(6)
                                                         for j in range(5))


def test_jobs_that_write_the_autotune_cache_at_once_keep_every_entry(tmp_path, monkeypatch):
  """Two writers add their own entries to one cache file at the same time
  (two jobs on one machine): both entries are in the file afterwards. The
  pause after each read widens the window that a read-modify-write without
  a lock loses an entry in."""
  path = str(tmp_path / "cache" / "autotune.json")
  read = tuning.load_cache

  def slow_read(where):
    found = read(where)
    time.sleep(0.3)
    return found

  monkeypatch.setattr(tuning, "load_cache", slow_read)
  _together(2, lambda i: tuning.remember(path, "section", {f"problem {i}": ["xla", f"job {i}"]}))
  assert read(path) == {"section": {"problem 0": ["xla", "job 0"],
                                    "problem 1": ["xla", "job 1"]}}
  assert sorted(p.name for p in (tmp_path / "cache").iterdir()
                if not p.name.endswith(".lock")) == ["autotune.json"]  # no temporary left


def _write_slowly(path: str, job: int, start) -> None:
  """One job's write of its entry (in a process of its own), after every job is ready."""
  read = tuning.load_cache

  def slow_read(where):
    found = read(where)
    time.sleep(0.3)
    return found

  tuning.load_cache = slow_read
  start.wait(timeout=120)
  tuning.remember(path, "section", {f"problem {job}": ["xla", f"job {job}"]})


def test_processes_that_write_the_autotune_cache_at_once_keep_every_entry(tmp_path):
  """As above, with two processes: the lock holds between jobs, not only threads."""
  path = str(tmp_path / "autotune.json")
  context = multiprocessing.get_context("spawn")
  start = context.Barrier(2)
  jobs = [context.Process(target=_write_slowly, args=(path, job, start)) for job in range(2)]
  for job in jobs:
    job.start()
  for job in jobs:
    job.join(timeout=120)
  assert [job.exitcode for job in jobs] == [0, 0]
  assert tuning.load_cache(path) == {"section": {"problem 0": ["xla", "job 0"],
                                                 "problem 1": ["xla", "job 1"]}}
