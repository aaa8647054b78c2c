"""The registry: the project's one piece of global state (``REGISTRY``): the C++
extension, loaded once, and whether cuBLASMp can run here; the NCCL groups
``connect`` made (the communicators live in the C++ registry); and the
process's routing plan, which ``connect`` and ``autotune`` replace and no
``jax.jit`` keys on. Tracing and lowering only read it."""

from __future__ import annotations

import atexit
import dataclasses
import threading
import warnings
from types import ModuleType

import jax

import jax_comm_gemm.runtime.native as native
import jax_comm_gemm.runtime.plan as plan_lib
from jax_comm_gemm.runtime.capability import (Capability, WorkspaceKey, default_layout,
                                              symmetric_memory, version_text)
from jax_comm_gemm.runtime.constants import TARGETS
from jax_comm_gemm.runtime.plan import Plan
from jax_comm_gemm.runtime.peers import Herald
from jax_comm_gemm.runtime.sentinel import Sentinel
from jax_comm_gemm.runtime.settings import Settings


@dataclasses.dataclass(frozen=True)
class CallCounters:
  """The fused calls this process's contexts ran, and the host time they took
  (each context counts its own: two GPUs in one process count a call twice).
  Subtract an earlier read for a span: at small GEMMs the host, not the GPU,
  sets the pace of back-to-back calls (docs/performance.md)."""
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
    # Reentrant: an update reads the plan in force (which may load the
    # extension) while it holds the lock.
    self._lock = threading.RLock()
    self.connect_lock = threading.Lock()  # one connect at a time: each is collective
    self._native: ModuleType | None = None
    self._status: Capability | None = None
    self._first: Plan | None = None           # the plan before any was published
    self._published: Plan | None = None       # the plan connect and autotune made
    self._groups: set[int] = set()            # NCCL groups made on this process
    self._attempts: dict = {}                 # exchange name -> attempts so far
    self._sentinel: Sentinel | None = None    # ends the process after an abort (sentinel.py)
    self._herald: Herald | None = None        # tells peers of a failure (peers.py)

  # --- the extension and the library ------------------------------------------

  def cublasmp_status(self) -> Capability:
    """Whether the cuBLASMp backend can run in this process, and why not; and
    on which groups connect found that cuBLASMp cannot get its workspace
    (there ``auto`` runs the project's own algorithms, the ring or XLA) or
    took a plain one (there cuBLASMp's default runs without overlap)."""
    status = self.library_status()
    found = [(k, v) for k, v in self.plan().verdicts if isinstance(k, WorkspaceKey)]
    refused = sorted({v.reason for _, v in found if not v.ok})
    plain = sorted({v.reason for _, v in found if v.ok and not symmetric_memory(v)})
    if not refused and not plain:
      return status
    return Capability(status.ok, "; ".join([status.reason, *refused, *plain]) +
                      (": backend='auto' runs the project's own algorithms, the ring or "
                       "XLA there" if refused else ""))

  def library_status(self) -> Capability:
    """Whether the extension and cuBLASMp load in this process, and why not."""
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
    for name, registration in module.types().items():  # before the handlers that use them
      jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    for name in TARGETS.values():
      jax.ffi.register_ffi_target(name, handlers[name], platform="CUDA")
    self._native = module
    return Capability(True, f"cuBLASMp {version_text(version)}, NCCL "
                            f"{version_text(module.nccl_version())}")

  def native(self) -> ModuleType:
    status = self.library_status()
    if self._native is None:
      raise RuntimeError(f"the cuBLASMp backend is unavailable: {status.reason}")
    return self._native

  def cublasmp_version(self) -> int:
    """major*10000 + minor*100 + patch, or 0 where cuBLASMp cannot run."""
    return self.native().cublasmp_version() if self.library_status().ok else 0

  # --- the routing plan -----------------------------------------------------------

  def plan(self) -> Plan:
    """The plan in force: a use() scope's, else the published one, else this
    process's first plan, whose settings are read from the environment at
    this first use."""
    found = plan_lib.scoped() or self._published
    if found is not None:
      return found
    if self._first is None:  # built once; a race builds two equal plans
      status = self.library_status()
      first = Plan(Settings.from_environ(), status, default_layout(self.cublasmp_version()))
      with self._lock:
        if self._first is None:
          self._first = first
    return self._first

  def publish(self, plan: Plan | None) -> None:
    """Makes `plan` the process's plan (None: back to the first plan). Programs
    traced before keep their routes; those traced after take `plan`'s."""
    with self._lock:
      self._published = plan

  def _update(self, change) -> None:
    """Publishes ``change(plan in force)``, reading and writing under one lock:
    two threads' updates both land (neither builds on a plan the other replaced)."""
    with self._lock:
      self._published = change(self.plan())

  def adopt(self, settings: Settings) -> None:
    """Publishes the plan in force with `settings` and what this process
    knows of cuBLASMp now (connect, once the settings are agreed)."""
    status = self.library_status()
    layout = default_layout(self.cublasmp_version())
    self._update(lambda plan: dataclasses.replace(plan, settings=settings, cublasmp=status,
                                                  layout=layout))

  # --- what connect() set up ----------------------------------------------------

  def comm_id(self, mesh, axis_name: str) -> int | None:
    """The comm_id of a connected mesh axis in the plan in force, or None."""
    return self.plan().comm_id(mesh, axis_name)

  def next_attempt(self, name) -> int:
    """How many exchanges named `name` this process began, this one included
    (the key-value store's keys carry it: a retry never reads an old value)."""
    with self._lock:
      self._attempts[name] = self._attempts.get(name, 0) + 1
      return self._attempts[name]

  def known_groups(self) -> set[int]:
    with self._lock:
      return set(self._groups)

  def record(self, mesh, axis_name: str, comm_id: int, groups, verdicts) -> None:
    """Publishes a plan with the connected axis and its verdicts."""
    with self._lock:
      self._groups.update(groups)
    self._update(lambda plan: plan.with_axis(mesh, axis_name, comm_id, verdicts))

  def watch(self, grace_s: float) -> None:
    """Starts the sentinel over this process's contexts (once)."""
    with self._lock:
      if self._sentinel is None:
        self._sentinel = Sentinel(self.contexts, grace_s).start()

  def herald(self, groups, comm_id: int, attempt: int, multi_process: bool) -> None:
    """Tells the peers of `groups` (made by connect's exchange `comm_id` /
    `attempt`) when a context here fails, and this process's contexts when a
    peer does (peers.py; started once)."""
    with self._lock:
      if self._herald is None:
        self._herald = Herald(self.contexts, self._native.abort).start()
      for group in groups:
        self._herald.watch(group, comm_id, attempt, multi_process)

  # --- autotune's choices ---------------------------------------------------------

  def record_decisions(self, decisions) -> None:
    """Publishes a plan with `decisions` ({problem: (implementation, why)})."""
    self._update(lambda plan: plan.with_decisions(decisions))

  # --- the contexts -------------------------------------------------------------------

  def contexts(self) -> list[dict]:
    """One dict per context on this process (device, rank, workspace bytes...)."""
    return self._native.contexts() if self._native is not None else []

  def call_counters(self) -> CallCounters:
    """The fused calls of this process's contexts since connect, and their host time."""
    contexts = self.contexts()
    return CallCounters(sum(c.get("calls", 0) for c in contexts),
                        sum(c.get("host_seconds", 0.0) for c in contexts), len(contexts))

  def shutdown(self, timeout_s: float = 60.0) -> None:
    """Destroys all contexts (at exit); collective, so all processes do it.
    A plan published after it has no connected axes."""
    with self._lock:
      if self._sentinel is not None:
        self._sentinel.stop()
        self._sentinel = None
      if self._herald is not None:
        self._herald.stop()
        self._herald = None
      if self._native is not None and not self._native.shutdown(timeout_s):
        warnings.warn("jax_comm_gemm: releasing the cuBLASMp contexts timed out "
                      f"after {timeout_s} s; leaving them to process exit")
      had_groups = bool(self._groups)
      self._groups.clear()
    if had_groups:
      self._update(lambda plan: dataclasses.replace(plan, axes=(), verdicts=()))


REGISTRY = Registry()
atexit.register(REGISTRY.shutdown)


def current_plan() -> Plan:
  """The routing plan in force (what tracing reads): ``REGISTRY.plan()``."""
  return REGISTRY.plan()
