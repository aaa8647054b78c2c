"""One of the two CPU processes of test_peer_failure.py.

Usage: ``python mp_peer_failure_worker.py PROCESS_ID PORT`` (2 CPU devices each).
Both processes ``connect`` a ('tp',) axis over their 4 devices with a stand-in
for the C++ extension whose contexts the worker drives, through the real
key-value store. Process 0's contexts then fail for their own reason (a planted
allocation failure); process 1 waits in a "call" that only an abort ends, as a
rank waiting in a collective for the failed one does, and reports how long it
waited and why it ended. Prints one JSON line:
``{"process": i, "ok": bool, "waited_s": float, "reason": str, "error": str}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

import jax
import numpy as np
from jax.sharding import Mesh

import jax_comm_gemm as jcg
import jax_comm_gemm.runtime.communicators as communicators
from jax_comm_gemm.runtime import REGISTRY, capability, kv
from jax_comm_gemm.runtime.capability import Capability

PLANTED = "ncclMemAlloc failed: out of memory (planted)"
CALL_TIMEOUT_S = 60  # what the peer would wait without the herald


class _StandIn:
  """The extension's part of connect, with contexts that can fail and be aborted."""

  def __init__(self):
    self.groups, self.errors = [], {}
    self.aborted = threading.Event()

  def cublasmp_version(self):
    return 1000

  def nccl_version(self):
    return 23203

  def nccl_unique_id(self):
    return bytes(128)

  def connect(self, groups, connect_timeout_s, call_timeout_s, time_gemms):
    self.groups += [(key, members) for key, _, _, members in groups]

  def bind(self, ident, device_groups):
    pass

  def contexts(self):
    return [{"group": key, "device": device, "rank": rank, "nranks": 4,
             "error": self.errors.get((key, device), ""), "workspace_error": ""}
            for key, members in self.groups for device, rank in members]

  def abort(self, group, device, reason):
    self.errors.setdefault((group, device), reason)
    self.aborted.set()
    return True

  def shutdown(self, timeout_s):
    return True


def main(process_id: int, port: int) -> dict:
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  native = _StandIn()
  REGISTRY._status, REGISTRY._native = Capability(True, "stand-in"), native
  communicators.self_test = lambda mesh, axis, ident, layout, version, *workspace: {
      key: Capability(True, "stand-in") for key in capability._cases(4, layout)}
  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  jcg.connect(mesh, "tp")
  assert native.groups, "connect made no group here"
  done = kv.key(1, 1, "peer_failure_test", "done")
  if process_id == 0:
    time.sleep(1.0)
    for key, members in native.groups:  # a context's own failure, as Context::Abort records it
      for device, _ in members:
        native.errors[(key, device)] = PLANTED
    kv.fetch(done, 60)  # the store lives in this process: stay until the peer has read it
    return {"waited_s": 0.0, "reason": PLANTED}
  start = time.monotonic()
  told = native.aborted.wait(CALL_TIMEOUT_S)
  waited = time.monotonic() - start
  kv.publish(done, "1")
  reasons = sorted({c["error"] for c in native.contexts()})
  assert told, f"no abort within {CALL_TIMEOUT_S} s"
  return {"waited_s": waited, "reason": reasons}


if __name__ == "__main__":
  pid = int(sys.argv[1])
  try:
    result = {"process": pid, "ok": True, **main(pid, int(sys.argv[2]))}
  except Exception as e:  # noqa: BLE001  (reported to the test)
    result = {"process": pid, "ok": False, "error": f"{e}\n{traceback.format_exc()}"}
  print(json.dumps(result), flush=True)
  REGISTRY.shutdown()
