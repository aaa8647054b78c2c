"""The sentinel ends a process whose group was aborted and which does not end
by itself (its main thread may be stuck in a GPU wait that ncclCommAbort does
not release: GPU run 15)."""

import threading

import pytest

from jax_comm_gemm.runtime import settings
from jax_comm_gemm.runtime.sentinel import Sentinel

ABORTED = {"device": 0, "rank": 1, "error": "a peer did not answer within 10 s "
                                            "(JAX_COMM_GEMM_TIMEOUT)"}


def test_leaves_once_the_error_has_stood_for_the_grace_period(capsys):
  now = [100.0]
  contexts = [[{"device": 0, "rank": 1, "error": ""}]]
  sentinel = Sentinel(lambda: contexts[0], grace_s=30, clock=lambda: now[0])
  assert sentinel.check() is None
  contexts[0] = [ABORTED]
  assert sentinel.check() is None  # the clock starts now, and the user is told
  assert "This process ends in 30 s unless it ends first" in capsys.readouterr().err
  now[0] += 29
  assert sentinel.check() is None
  now[0] += 1
  message = sentinel.check()
  assert message.startswith("jax_comm_gemm: ending the process: the tensor-parallel group's "
                            "communicator was aborted 30 s ago")
  assert ABORTED["error"] in message


def test_the_thread_calls_leave():
  left = threading.Event()
  messages = []

  def leave(message):
    messages.append(message)
    left.set()

  sentinel = Sentinel(lambda: [ABORTED], grace_s=0, leave=leave).start()
  assert left.wait(5.0), "the sentinel did not leave"
  sentinel.stop()
  assert ABORTED["error"] in messages[0]


def test_settings():
  assert settings.Settings.from_environ({}).on_abort == "exit"
  assert settings.Settings.from_environ({}).abort_grace_s == 60.0
  with pytest.raises(ValueError, match=r"JAX_COMM_GEMM_ON_ABORT='ignore': allowed values"):
    settings.Settings.from_environ({settings.ON_ABORT: "ignore"})
