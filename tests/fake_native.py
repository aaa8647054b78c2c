"""A stand-in for the C++ extension, so that ``connect`` runs on a CPU: it
records what the runtime asks of the extension, and the layout self-test is
replaced by verdicts the test chooses."""

import jax_comm_gemm.runtime.communicators as connect_module
import jax_comm_gemm.runtime.plan as plan_lib
from conftest import stand_in_plan
from jax_comm_gemm.runtime import REGISTRY, capability
from jax_comm_gemm.runtime.capability import Capability


class FakeNative:
  """Records what the runtime asks of the extension."""

  def __init__(self):
    self.connected, self.bound = [], []

  def cublasmp_version(self):
    return 1000

  def nccl_version(self):
    return 23203

  def nccl_unique_id(self):
    return bytes(128)

  def connect(self, groups, connect_timeout_s, call_timeout_s, time_gemms):
    self.connected.append({"groups": [(key, n, members) for key, _, n, members in groups],
                           "timeouts": (connect_timeout_s, call_timeout_s),
                           "time_gemms": time_gemms})

  def bind(self, ident, device_groups):
    self.bound.append((ident, device_groups))

  def contexts(self):
    return []

  def shutdown(self, timeout_s):
    return True  # every context released in time


def fake_self_test(passing=lambda key: True):
  def run(mesh, axis_name, ident, layout, version):
    return {key: Capability(passing(key), "fake self-test")
            for key in capability._cases(int(mesh.shape[axis_name]), layout)}
  return run


def install_fake_native(monkeypatch, passing=lambda key: True) -> FakeNative:
  """REGISTRY with cuBLASMp "available" through a FakeNative, emptied for the
  test, and a self-test whose verdicts pass where `passing(key)` says."""
  native = FakeNative()
  for name, value in [("_status", Capability(True, "stand-in")), ("_native", native),
                      ("_groups", set()), ("_attempts", {}), ("_wanted", {}), ("_seen", {}),
                      ("_sentinel", None), ("_first", None)]:
    monkeypatch.setattr(REGISTRY, name, value)
  monkeypatch.setattr(connect_module, "self_test", fake_self_test(passing))
  plan_lib.publish(stand_in_plan())
  return native
