"""The registry's bookkeeping, with a stand-in for the C++ extension.

What the lowering rule asks of the registry (bind_axis) runs on CPU here: which
groups a mesh axis forms, one connect per new group with this process's
(device, rank) pairs, one bind per axis, idempotence, and no deadlock on its
own lock (a real one happened on the GPU machine).
"""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_comm_gemm.backends import Capability
from jax_comm_gemm.registry import ENV_FENCE, Registry, stable_key


class FakeNative:
  """Records what the registry asks of the extension."""

  def __init__(self):
    self.connected, self.bound, self.fences_used = [], [], []

  def fences(self):
    return ["isolated", "own_stream", "none"]

  def nccl_unique_id(self):
    return bytes(128)

  def connect(self, groups, fence, timeout_s):
    self.fences_used.append(fence)
    self.connected.append([(key, nranks, members) for key, _, nranks, members in groups])

  def bind(self, comm_id, device_groups):
    self.bound.append((comm_id, device_groups))


def ready_registry() -> Registry:
  registry = Registry()
  registry._status = Capability(True, "stand-in")
  registry._native = FakeNative()
  return registry


def call_in_thread(fn, timeout_s=20.0):
  out = {}
  thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
  thread.start()
  thread.join(timeout_s)
  assert not thread.is_alive(), "deadlocked"
  return out["value"]


def test_bind_axis_groups_along_the_axis():
  devices = np.asarray(jax.devices("cpu")[:8]).reshape(2, 4)
  mesh = Mesh(devices, ("dp", "tp"))
  registry = ready_registry()
  comm_id = call_in_thread(lambda: registry.bind_axis(mesh, "tp"))
  (groups,) = registry._native.connected
  # Two tp groups (the rows), ranks in axis order, devices by local id.
  assert [(nranks, members) for _, nranks, members in groups] == [
      (4, [(int(d.local_hardware_id), r) for r, d in enumerate(row)]) for row in devices]
  (bound_id, device_groups), = registry._native.bound
  assert bound_id == comm_id
  assert sorted(d for d, _ in device_groups) == sorted(int(d.local_hardware_id)
                                                       for d in devices.flat)


def test_bind_axis_is_idempotent_and_shares_groups():
  devices = np.asarray(jax.devices("cpu")[:4])
  registry = ready_registry()
  a = Mesh(devices, ("tp",))
  first = call_in_thread(lambda: registry.bind_axis(a, "tp"))
  again = call_in_thread(lambda: registry.bind_axis(a, "tp"))
  assert first == again
  assert len(registry._native.connected) == 1 and len(registry._native.bound) == 1
  # Another mesh whose axis forms the same group reuses it all.
  b = Mesh(devices.reshape(1, 4), ("dp", "tp"))
  assert call_in_thread(lambda: registry.bind_axis(b, "tp")) == first
  # The same devices in another order form another group: a new communicator.
  c = Mesh(devices[::-1], ("tp",))
  assert call_in_thread(lambda: registry.bind_axis(c, "tp")) != first
  assert len(registry._native.connected) == 2 and len(registry._native.bound) == 2


def test_a_different_axis_makes_different_groups():
  devices = np.asarray(jax.devices("cpu")[:4]).reshape(2, 2)
  mesh = Mesh(devices, ("dp", "tp"))
  registry = ready_registry()
  tp = call_in_thread(lambda: registry.bind_axis(mesh, "tp"))
  dp = call_in_thread(lambda: registry.bind_axis(mesh, "dp"))
  assert tp != dp
  keys = [key for groups in registry._native.connected for key, _, _ in groups]
  assert len(keys) == len(set(keys)) == 4


def test_stable_key_is_deterministic_and_non_negative():
  assert stable_key(("group", (0, 1))) == stable_key(("group", (0, 1)))
  assert stable_key(("group", (0, 1))) != stable_key(("group", (1, 0)))
  assert 0 <= stable_key("x") < 2**63


def test_without_cublasmp_the_verdict_says_why():
  registry = Registry()
  verdict = registry.gathered_reuse(2, "split_p2p", np.float32)
  assert not verdict.ok and "not GPU" in verdict.reason
  assert registry.cublasmp_version() == 0


def test_the_fence_comes_from_the_environment_else_the_first_name(monkeypatch):
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  monkeypatch.delenv(ENV_FENCE, raising=False)
  registry = ready_registry()
  registry.bind_axis(mesh, "tp")
  monkeypatch.setenv(ENV_FENCE, "own_stream")
  other = ready_registry()
  other.bind_axis(mesh, "tp")
  assert (registry._native.fences_used, other._native.fences_used) == (["isolated"],
                                                                       ["own_stream"])


def test_a_bad_fence_fails_before_any_set_up(monkeypatch):
  monkeypatch.setenv(ENV_FENCE, "sync")
  registry = ready_registry()
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  with pytest.raises(ValueError, match="JAX_COMM_GEMM_FENCE='sync' is not a fence; use one of "
                                       "isolated, own_stream, none"):
    registry.bind_axis(mesh, "tp")
  assert registry._native.connected == [] and registry._native.bound == []
