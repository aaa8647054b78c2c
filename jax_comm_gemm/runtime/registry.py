"""The registry: the project's one piece of global state (``REGISTRY``).

It holds what this process knows about the cuBLASMp runtime, and nothing else:

* the C++ extension, loaded once (``native.py``), and whether cuBLASMp can run
  here at all (``cublasmp_status``);
* the mesh axes that ``connect`` set up, and the NCCL groups behind them (the
  communicators themselves live in the C++ registry, which owns every context);
* the capability verdicts of the self-test (``verdict``), which the custom_vjp
  rules read at trace time;
* the choices of ``backend="auto"`` per problem (``decision``), measured by
  ``backends.autotune``, and the problems traced without one (``wanted``).

Reading it never touches NCCL: tracing, lowering and ``jax.eval_shape`` only
read. Everything collective happens in ``communicators.connect``.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import warnings
from types import ModuleType

import jax

import jax_comm_gemm.runtime.native as native
from jax_comm_gemm.runtime.sentinel import Sentinel
from jax_comm_gemm.runtime.capability import (Capability, VerdictKey, default_layout,
                                              untested, version_text)
from jax_comm_gemm.runtime.constants import TARGETS


def axis_key(mesh, axis_name: str) -> tuple:
  """What trace time can see of a mesh axis (the abstract mesh inside
  shard_map has names and sizes, not devices)."""
  return (axis_name, tuple(mesh.axis_names), tuple(int(s) for s in mesh.shape.values()))


@dataclasses.dataclass(frozen=True)
class CallCounters:
  """The fused calls this process's contexts ran, and the host time they took
  (each context counts its own: two GPUs in one process count a call twice).
  Subtract an earlier read for a span: at small GEMMs the host, not the GPU,
  sets the pace of back-to-back calls (GPU run 53)."""
  calls: int = 0
  host_seconds: float = 0.0
  contexts: int = 0

  def __sub__(self, earlier: "CallCounters") -> "CallCounters":
    return CallCounters(self.calls - earlier.calls, self.host_seconds - earlier.host_seconds,
                        max(self.contexts, earlier.contexts))

  def __add__(self, other: "CallCounters") -> "CallCounters":
    return CallCounters(self.calls + other.calls, self.host_seconds + other.host_seconds,
                        max(self.contexts, other.contexts))

  def host_us_per_call(self) -> float | None:
    return self.host_seconds / self.calls * 1e6 if self.calls > 0 else None


class Registry:
  """See the module docstring. Thread-safe; a single instance, ``REGISTRY``."""

  def __init__(self):
    self._lock = threading.Lock()
    self.connect_lock = threading.Lock()  # one connect at a time: each is collective
    self._native: ModuleType | None = None
    self._status: Capability | None = None
    self._axes: dict[tuple, int] = {}         # axis_key -> comm_id
    self._groups: set[int] = set()            # NCCL groups made on this process
    self._attempts: dict[int, int] = {}       # comm_id -> connect attempts so far
    self._verdicts: dict[VerdictKey, Capability] = {}
    self._decisions: dict = {}                # problem key -> (implementation, reason)
    self._wanted: dict = {}                   # traced problems without a decision, in order
    self._seen: dict = {}                     # every problem traced since forget_seen()
    self._sentinel: Sentinel | None = None    # ends the process after an abort (sentinel.py)

  # --- the extension and the library ------------------------------------------

  def cublasmp_status(self) -> Capability:
    """Whether the cuBLASMp backend can run in this process, and why not."""
    with self._lock:
      if self._status is None:
        self._status = self._load()
      return self._status

  def _load(self) -> Capability:
    if jax.default_backend() != "gpu":
      return Capability(False, f"the default JAX backend is {jax.default_backend()!r}, "
                               "not GPU")
    module, reason = native.load()
    if module is None:
      return Capability(False, reason)
    version = module.cublasmp_version()
    if version == 0:
      return Capability(False, "cuBLASMp loaded but reported no version")
    handlers = module.handlers()
    for name in TARGETS.values():
      jax.ffi.register_ffi_target(name, handlers[name], platform="CUDA")
    self._native = module
    return Capability(True, f"cuBLASMp {version_text(version)}, NCCL "
                            f"{version_text(module.nccl_version())}")

  def native(self) -> ModuleType:
    status = self.cublasmp_status()
    if self._native is None:
      raise RuntimeError(f"the cuBLASMp backend is unavailable: {status.reason}")
    return self._native

  def cublasmp_version(self) -> int:
    """major*10000 + minor*100 + patch, or 0 where cuBLASMp cannot run."""
    return self.native().cublasmp_version() if self.cublasmp_status().ok else 0

  def default_layout(self) -> str:
    return default_layout(self.cublasmp_version())

  # --- what connect() set up ----------------------------------------------------

  def comm_id(self, mesh, axis_name: str) -> int | None:
    """The comm_id of a connected mesh axis, or None (trace time: a dict read)."""
    with self._lock:
      return self._axes.get(axis_key(mesh, axis_name))

  def next_attempt(self, comm_id: int) -> int:
    with self._lock:
      self._attempts[comm_id] = self._attempts.get(comm_id, 0) + 1
      return self._attempts[comm_id]

  def known_groups(self) -> set[int]:
    with self._lock:
      return set(self._groups)

  def record(self, mesh, axis_name: str, comm_id: int, groups, verdicts) -> None:
    with self._lock:
      self._groups.update(groups)
      self._verdicts.update(verdicts)
      self._axes[axis_key(mesh, axis_name)] = comm_id

  def watch(self, grace_s: float) -> None:
    """Starts the sentinel over this process's contexts (once)."""
    with self._lock:
      if self._sentinel is None:
        self._sentinel = Sentinel(self.contexts, grace_s).start()

  def verdict(self, key: VerdictKey) -> Capability:
    """The self-test's verdict for `key`; a failing one where none was taken."""
    with self._lock:
      found = self._verdicts.get(key)
    return found if found is not None else untested(key)

  def decision(self, key):
    """The measured choice for a problem, or None (and the problem is noted
    as wanted, for the next autotune)."""
    with self._lock:
      self._seen.setdefault(key, None)
      found = self._decisions.get(key)
      if found is None:
        self._wanted.setdefault(key, None)
      return found

  def record_decision(self, key, decision) -> None:
    with self._lock:
      self._decisions[key] = decision
      self._wanted.pop(key, None)

  def wanted(self) -> list:
    with self._lock:
      return list(self._wanted)

  def seen(self) -> list:
    """The problems traced since the last forget_seen(), in order."""
    with self._lock:
      return list(self._seen)

  def forget_seen(self) -> None:
    with self._lock:
      self._seen.clear()

  def contexts(self) -> list[dict]:
    """One dict per context on this process (device, rank, workspace bytes...)."""
    return self._native.contexts() if self._native is not None else []

  def call_counters(self) -> CallCounters:
    """The fused calls of this process's contexts since connect, and their host time."""
    contexts = self.contexts()
    return CallCounters(sum(c.get("calls", 0) for c in contexts),
                        sum(c.get("host_seconds", 0.0) for c in contexts), len(contexts))

  def shutdown(self, timeout_s: float = 60.0) -> None:
    """Destroys all contexts (at exit); collective, so all processes do it."""
    with self._lock:
      if self._sentinel is not None:
        self._sentinel.stop()
        self._sentinel = None
      if self._native is not None and not self._native.shutdown(timeout_s):
        warnings.warn("jax_comm_gemm: releasing the cuBLASMp contexts timed out "
                      f"after {timeout_s} s; leaving them to process exit")
      self._groups.clear()
      self._axes.clear()


REGISTRY = Registry()
atexit.register(REGISTRY.shutdown)
