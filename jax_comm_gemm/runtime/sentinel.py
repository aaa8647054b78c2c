"""The sentinel: a thread that ends the process when a communicator was aborted
and the process does not end by itself. ``ncclCommAbort`` does not release a
GPU wait on a dead peer, so after the watchdog aborts a group the main thread
may never see the error (docs/design.md#the-sentinel). As PyTorch's NCCL
watchdog does, this thread prints the aborted context's reason and exits with
status 1 if the process still runs ``JAX_COMM_GEMM_ABORT_GRACE`` seconds after
the abort; ``JAX_COMM_GEMM_ON_ABORT=wait`` turns it off."""

from __future__ import annotations

import os
import sys
import threading
import time

import jax_comm_gemm.runtime.settings as settings

POLL_S = 0.5


class Sentinel:
  """Polls `contexts()` (dicts with an "error" key) and calls `leave(message)`
  once an error has stood for `grace_s` seconds."""

  def __init__(self, contexts, grace_s: float, leave=None, clock=time.monotonic):
    self._contexts, self._grace_s = contexts, grace_s
    self._leave = leave or _exit_process
    self._clock = clock
    self._since: float | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jax_comm_gemm-sentinel",
                                    daemon=True)

  def start(self) -> "Sentinel":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def check(self) -> str | None:
    """One look: the message to leave with, once an error has stood long enough."""
    errors = sorted({c["error"] for c in self._contexts() if c.get("error")})
    if not errors:
      return None
    now = self._clock()
    if self._since is None:
      self._since = now
      print(f"jax_comm_gemm: {'; '.join(errors)}. This process ends in {self._grace_s:g} s "
            f"unless it ends first ({settings.ON_ABORT}=wait keeps it)", file=sys.stderr,
            flush=True)
    if now - self._since < self._grace_s:
      return None
    return (f"jax_comm_gemm: ending the process: the tensor-parallel group's communicator "
            f"was aborted {now - self._since:.0f} s ago and the process is still running: "
            + "; ".join(errors))

  def _run(self) -> None:
    while not self._stop.wait(POLL_S):
      message = self.check()
      if message:
        self._leave(message)
        return


def _exit_process(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
  os._exit(1)  # the main thread may be blocked in a GPU wait that nothing releases
