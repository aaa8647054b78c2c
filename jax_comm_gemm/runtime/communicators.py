"""Communicators: ``connect``, the one collective set-up step of the cuBLASMp
backend. For one mesh axis it checks that every process agrees on its settings,
makes the NCCL communicators of the axis's tensor-parallel groups (one per
group and local device, owned by the C++ registry), learns whether cuBLASMp can
get its workspace on them, and runs the layout self-test. It is explicit and
runs outside any trace: tracing and lowering only read what it recorded
(``comm_id`` is a pure function of the mesh). Why not while lowering or in the
handler's stages: docs/design.md#explicit-set-up-connect."""

from __future__ import annotations

import hashlib
import importlib.metadata

import jax
import numpy as np

import jax_comm_gemm.runtime.agreement as agreement
import jax_comm_gemm.validation as validation
import jax_comm_gemm.runtime.kv as kv
from jax_comm_gemm.runtime.capability import (Capability, WorkspaceKey, cublasmp_refusal,
                                              self_test, symmetric_memory,
                                              workspace_verdict)
from jax_comm_gemm.runtime.registry import REGISTRY, Registry
from jax_comm_gemm.runtime.settings import BACKEND, Settings


def stable_key(value) -> int:
  """The same non-negative int64 in every process for the same `value`."""
  digest = hashlib.sha256(repr(value).encode()).digest()
  return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def axis_groups(mesh, axis_name: str) -> np.ndarray:
  """The devices of each tensor-parallel group that `axis_name` forms, one
  row per group, in rank order."""
  devices = np.asarray(mesh.devices)
  axis = list(mesh.axis_names).index(axis_name)
  return np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])


def comm_id(mesh, axis_name: str) -> int:
  """The id that a custom call carries to name the groups of a mesh axis
  (pure: no registry, no NCCL; the lowering rule calls it).

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> comm_id(mesh, "tp") == comm_id(mesh, "tp") >= 0
  True
  """
  groups = axis_groups(mesh, axis_name)
  return stable_key(("axis", tuple(tuple(d.id for d in g) for g in groups)))


def fingerprint(settings: Settings, native=None) -> dict[str, str]:
  """What every process of a group must share: versions and settings."""
  try:
    package = importlib.metadata.version("jax-comm-gemm")
  except importlib.metadata.PackageNotFoundError:
    package = "unknown"
  found = {"jax_comm_gemm version": package, "jax version": jax.__version__,
           **settings.fingerprint()}
  if native is not None:
    found.update({"cuBLASMp version": str(native.cublasmp_version()),
                  "NCCL version": str(native.nccl_version())})
  return found


def connect(mesh, axis_name: str = "tp", *, config=None,
            registry: Registry = REGISTRY) -> Capability:
  """Sets up the cuBLASMp backend on `axis_name` of `mesh` (collective): call it
  once in every process, with the same mesh, after ``jax.distributed.initialize()``
  and before the programs that use the axis run. Without it ``backend="auto"``
  runs XLA and ``backend="cublasmp"`` raises.

  On every platform it first checks the ``JAX_COMM_GEMM_*`` settings (a
  ValueError naming the variable) and compares them and the versions across the
  processes (a ``DisagreementError`` naming the setting and the processes).
  Where cuBLASMp can run, it then makes the communicators, learns whether
  cuBLASMp gets its workspace on them (where not, ``auto`` leaves cuBLASMp's
  algorithms out), runs the layout self-test, and publishes a new routing plan,
  which programs traced after it take. `config`, a ``CommGemmConfig`` the layers
  will run with, is checked against what can run on the axis.

  Returns whether the axis can use the fused ops, and why not. Raises
  TimeoutError when a peer does not come, RuntimeError when NCCL or cuBLASMp
  fail (with their message); a failed connect can be called again.

  >>> import jax, numpy as np, jax_comm_gemm as jcg
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> jcg.connect(mesh, "tp").ok  # on a CPU: cuBLASMp cannot run here
  False
  """
  validation.mesh_axis_size("connect", mesh, axis_name)
  settings = Settings.from_environ()  # bad values fail here, before any collective
  ident = comm_id(mesh, axis_name)
  processes = sorted({d.process_index for d in np.asarray(mesh.devices).flat})
  status = registry.library_status()
  with registry.connect_lock:
    attempt = registry.next_attempt(ident)
    native = registry.native() if status.ok else None
    agreement.check(fingerprint(settings, native), comm_id=ident, attempt=attempt,
                    processes=processes, timeout_s=settings.connect_timeout_s)
    registry.adopt(settings)
    if not status.ok:
      return status
    if mesh.shape[axis_name] == 1:
      return Capability(True, f"axis {axis_name!r} has size 1: nothing to communicate")
    if registry.comm_id(mesh, axis_name) != ident:
      _make_communicators(mesh, axis_name, ident, attempt, native, settings, registry,
                          processes)
    workspace = registry.plan().verdict(WorkspaceKey(int(mesh.shape[axis_name])))
    asked = (f"{BACKEND}=cublasmp" if settings.backend == "cublasmp"
             else "backend='cublasmp'")
    if config is not None and (settings.backend or config.backend) == "cublasmp":
      why = cublasmp_refusal(config, workspace, f"connect({axis_name!r}): {asked}")
      if why:
        raise RuntimeError(why)
    return (status if symmetric_memory(workspace)
            else Capability(True, f"{status.reason}; {workspace.reason}"))


def _make_communicators(mesh, axis_name, ident, attempt, native, settings: Settings,
                        registry: Registry, processes) -> None:
  me = jax.process_index()
  known = registry.known_groups()
  new_groups, device_groups = [], []
  for group in axis_groups(mesh, axis_name):
    local = [(int(d.local_hardware_id), rank) for rank, d in enumerate(group)
             if d.process_index == me]
    if not local:
      continue
    key = stable_key(("group", tuple(d.id for d in group)))
    device_groups += [(device, key) for device, _ in local]
    if key not in known:
      unique_id = _unique_id(native, ident, attempt, key, group[0].process_index == me,
                             settings.connect_timeout_s)
      new_groups.append((key, unique_id, len(group), local))
  if new_groups:
    native.connect(new_groups, settings.connect_timeout_s, settings.call_timeout_s,
                   settings.measuring)
  native.bind(ident, device_groups)
  size = int(mesh.shape[axis_name])
  workspace = workspace_verdict(size, *_workspace_error(native, device_groups, ident, attempt,
                                                        processes, settings.connect_timeout_s))
  # Only the layout the plan reads (the version's) is tested: no route reads
  # a verdict of the other.
  verdicts = self_test(mesh, axis_name, ident, registry.plan().layout,
                       registry.cublasmp_version(), workspace)
  # Keyed by group size, as the layout verdicts are: a refusal on another
  # axis of this size stands (the routes there cannot tell the axes apart).
  known = registry.plan().verdict(WorkspaceKey(size))
  verdicts[WorkspaceKey(size)] = min(workspace, known, key=_workspace_rank)
  registry.record(mesh, axis_name, ident, [g[0] for g in new_groups], verdicts)
  if new_groups and hasattr(native, "abort"):
    registry.herald([g[0] for g in new_groups], ident, attempt, kv.multi_process())
  if settings.on_abort == "exit":
    registry.watch(settings.abort_grace_s)


def _workspace_rank(verdict: Capability) -> int:
  """Refused < plain < symmetric: where two axes of one size differ, the worse stands."""
  return 0 if not verdict.ok else (1 if not symmetric_memory(verdict) else 2)


def _workspace_error(native, device_groups, ident: int, attempt: int, processes,
                     timeout_s: float) -> tuple[str, bool]:
  """The first refusal of cuBLASMp's workspace among the contexts of the
  axis's groups, in any process ("" where none refused), and whether every
  context of them took a plain workspace instead (the extension's plain mode,
  which a mix of symmetric and plain contexts cannot use): every process
  decides the same, so every rank routes alike."""
  found = {(c["device"], c["group"]): (c.get("workspace_error", ""),
                                       c.get("workspace_mode", "") == "plain")
           for c in native.contexts()}
  mine = [found.get(pair, ("", False)) for pair in device_groups]
  seen = kv.all_gather(ident, attempt, "workspace", value=mine, timeout_s=timeout_s,
                       processes=processes)
  everyone = [tuple(context) for process in seen for context in process]
  error = next((error for error, _ in everyone if error), "")
  return error, bool(error) and all(plain for _, plain in everyone)


def _unique_id(native, ident: int, attempt: int, group_key: int, is_leader: bool,
               timeout_s: float) -> bytes:
  """The group's NCCL unique id: made by its leader, shared with the other
  processes through the key-value store."""
  if not kv.multi_process():
    return native.nccl_unique_id()
  name = kv.key(ident, attempt, "nccl_unique_id", f"{group_key:016x}")
  if is_leader:
    unique_id = native.nccl_unique_id()
    kv.publish(name, unique_id.hex())
    return unique_id
  return bytes.fromhex(kv.fetch(name, timeout_s))
