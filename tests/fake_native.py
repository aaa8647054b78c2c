"""A stand-in for the C++ extension, so that ``connect`` runs on a CPU: it
records what the runtime asks of the extension, its contexts may refuse
cuBLASMp's workspace as the library does where NCCL has no symmetric memory,
and the layout self-test's GPU program by verdicts the test chooses."""

from conftest import stand_in_plan
from jax_comm_gemm.runtime import REGISTRY, capability
from jax_comm_gemm.runtime.capability import Capability


class FakeNative:
  """Records what the runtime asks of the extension."""

  def __init__(self, workspace_error: str = "", workspace_mode: str | None = None):
    self.connected, self.bound = [], []
    self.workspace_error = workspace_error  # each context's, as Context::Init finds it
    # "symmetric" or "plain" (the extension's mode where cublasMpMalloc is
    # refused); None: no such key, as from an extension without the plain mode.
    self.workspace_mode = workspace_mode

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
    made = {(device, key) for call in self.connected for key, _, members in call["groups"]
            for device, _ in members}
    mode = {} if self.workspace_mode is None else {"workspace_mode": self.workspace_mode}
    return [{"device": device, "group": key, "error": "",
             "workspace_error": self.workspace_error, **mode}
            for device, key in sorted(made)]

  def shutdown(self, timeout_s):
    return True  # every context released in time


def fake_probe(passing=lambda key: True, ran=None, workspace_error: str = ""):
  """Stands in for the self-test's GPU program (capability._probe): verdicts
  that pass where `passing(key)` says; with `workspace_error`, cuBLASMp's
  cases could not run, as on a GPU where its workspace is refused. `ran`, a
  list, collects the algorithms whose cases it was asked to run."""
  def run(mesh, axis_name, ident, layout, version, cases):
    if ran is not None:
      ran.extend(c.algorithm for c in cases if c.algorithm not in ran)
    return {case: (Capability(False, f"the layout self-test could not run: {workspace_error}")
                   if workspace_error and case.algorithm in capability.CUBLASMP_ALGORITHMS
                   else Capability(passing(case), "fake self-test"))
            for case in cases}
  return run


def install_fake_native(monkeypatch, passing=lambda key: True,
                        workspace_error: str = "",
                        workspace_mode: str | None = None) -> FakeNative:
  """REGISTRY with cuBLASMp "available" through a FakeNative, emptied for the
  test, and a self-test whose probes pass where `passing(key)` says; the
  contexts refuse cuBLASMp's workspace with `workspace_error` if given, and
  report `workspace_mode` (with "plain" cuBLASMp's cases run in the self-test)."""
  native = FakeNative(workspace_error, workspace_mode)
  for name, value in [("_status", Capability(True, "stand-in")), ("_native", native),
                      ("_groups", set()), ("_attempts", {}),
                      ("_sentinel", None), ("_herald", None), ("_first", None)]:
    monkeypatch.setattr(REGISTRY, name, value)
  unrunnable = "" if workspace_mode == "plain" else workspace_error
  monkeypatch.setattr(capability, "_probe", fake_probe(passing, workspace_error=unrunnable))
  REGISTRY.publish(stand_in_plan())
  return native
