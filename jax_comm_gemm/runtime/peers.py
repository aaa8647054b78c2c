"""A rank that fails tells its peers. When a context of this process is aborted
for its own reason (a failed allocation, a library error, a refused plan, a
wait past the deadline), the herald publishes the reason in jax.distributed's
key-value store, under the group that ``connect`` made; and when a peer of a
healthy context here has published one, it aborts that context with "rank R
failed: <its reason>", so that its waiting calls end within a poll and Abort's
grace instead of waiting out ``JAX_COMM_GEMM_TIMEOUT``
(docs/design.md#failures-become-errors). Contexts of one group in this process
(one process driving several GPUs) tell each other the same way, without the
store.

The herald reads the contexts through `contexts()` and acts through
`abort(group, device, reason)` and the store's `publish(name, value)` and
`listing(prefix)`: all passed in, so that tests drive it without a GPU."""

from __future__ import annotations

import json
import sys
import threading
import time

import jax_comm_gemm.runtime.kv as kv

POLL_S = 0.25


class Herald:
  """See the module docstring. `check()` is one look; `start()` polls it."""

  def __init__(self, contexts, abort, publish=None, listing=None, clock=time.time,
               poll_s: float = POLL_S):
    self._contexts, self._abort = contexts, abort
    self._publish = publish or kv.publish
    self._listing = listing or kv.listing
    self._clock, self._poll_s = clock, poll_s
    self._lock = threading.Lock()
    self._scopes: dict[int, tuple[int, int]] = {}   # group -> (comm_id, attempt) of its keys
    self._multi: dict[int, bool] = {}               # group -> whether peers are in other processes
    self._told: set[tuple[int, int]] = set()        # (group, device) aborted for a peer
    self._published: set[tuple[int, int]] = set()   # (group, rank) whose failure was published
    self._seen: dict[tuple[int, int], float] = {}   # (group, rank) -> when its failure was seen
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def watch(self, group: int, comm_id: int, attempt: int, multi_process: bool) -> None:
    """Watches `group`, made by connect's exchange `comm_id`/`attempt` (the keys
    carry them, so a group made again never reads an older failure)."""
    with self._lock:
      self._scopes[group] = (comm_id, attempt)
      self._multi[group] = multi_process

  def start(self) -> "Herald":
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="jax_comm_gemm-herald",
                                      daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def _prefix(self, group: int) -> str:
    comm_id, attempt = self._scopes[group]
    return kv.key(comm_id, attempt, "failed", f"{group:016x}") + "/"

  def check(self) -> list[tuple[int, int, str]]:
    """One look: publishes this process's own failures, aborts the healthy
    contexts whose group has a failed rank; returns the aborts made
    (group, device, reason)."""
    with self._lock:
      scopes, multi = dict(self._scopes), dict(self._multi)
    contexts = [c for c in self._contexts() if c["group"] in scopes]
    now = self._clock()
    failures: dict[int, list[tuple[float, int, str]]] = {}
    for c in contexts:  # this process's own failures: published, and known here
      group, rank, error = c["group"], c["rank"], c.get("error", "")
      if not error or (group, c["device"]) in self._told:
        continue
      at = self._seen.setdefault((group, rank), now)
      failures.setdefault(group, []).append((at, rank, error))
      if multi[group] and (group, rank) not in self._published:
        self._published.add((group, rank))
        self._publish(self._prefix(group) + str(rank),
                      json.dumps({"rank": rank, "reason": error, "at": at}))
    healthy = [c for c in contexts if not c.get("error")]
    for group in {c["group"] for c in healthy if multi[c["group"]]}:
      for _, value in self._listing(self._prefix(group)):
        told = json.loads(value)
        failures.setdefault(group, []).append((told["at"], told["rank"], told["reason"]))
    aborted = []
    for c in healthy:
      found = [f for f in failures.get(c["group"], []) if f[1] != c["rank"]]
      if not found:
        continue
      _, rank, reason = min(found)  # the first to fail: the others may fail from it
      message = f"rank {rank} failed: {reason}"
      self._told.add((c["group"], c["device"]))
      self._abort(c["group"], c["device"], message)
      aborted.append((c["group"], c["device"], message))
    return aborted

  def _run(self) -> None:
    while not self._stop.wait(self._poll_s):
      try:
        self.check()
      except Exception as e:  # noqa: BLE001  (a store gone at exit must not end the process)
        print(f"jax_comm_gemm: the herald of failures stopped: {e}", file=sys.stderr,
              flush=True)
        return
