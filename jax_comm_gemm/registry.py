"""The registry of cuBLASMp contexts, and the cached facts about them.

This is the project's one piece of global state (``REGISTRY``). It holds

* the C++ extension, loaded once (``_native.py``), and whether cuBLASMp can run
  here at all (``cublasmp_status``);
* the NCCL communicators: one per tensor-parallel group and device, created
  while the ops are lowered (``bind_axis``) and owned by the C++ side, which
  destroys them at exit;
* the capability verdicts that the custom_vjp rules read at trace time
  (``gathered_reuse``): may a weight gradient take the operand that a fused
  AllGather+GEMM left in cuBLASMp's workspace? The answer comes from the
  cuBLASMp version (which layout to expect) and a self-test that runs a small
  AllGather+GEMM on a known pattern and compares the exposed operand with
  ``lax.all_gather``, bit for bit. It is computed once per (group size,
  algorithm, dtype, layout) and never by raising and catching per call.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import warnings
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import _native
from jax_comm_gemm.backends import Capability
from jax_comm_gemm.config import ALGORITHMS

ENV_CONNECT_TIMEOUT = "JAX_COMM_GEMM_CONNECT_TIMEOUT"
# How each call is ordered against XLA's work (xla_ffi/context.h, Fence), read
# when communicators are set up; the extension's fences() lists the names.
ENV_FENCE = "JAX_COMM_GEMM_FENCE"
# cuBLASMp 0.11.0 documents the gathered B at the start of its workspace.
FRONT_LAYOUT_SINCE = 1100
# (local tokens, features, local outputs) of the self-test's AllGather+GEMMs.
PROBE_SHAPES = ((256, 1024, 512), (1024, 2048, 1024))


def stable_key(value) -> int:
  """The same non-negative int64 in every process for the same `value`."""
  digest = hashlib.sha256(repr(value).encode()).digest()
  return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def exchange_unique_id(key: int, is_leader: bool, make_id, timeout_s: float) -> bytes:
  """The group's NCCL unique id: made by its leader, shared with the other
  processes through jax.distributed's key-value store."""
  if jax.process_count() == 1:
    return make_id()
  from jax._src import distributed  # noqa: PLC0415  (no public key-value API yet)

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError(
        "jax_comm_gemm: several JAX processes but no jax.distributed client; "
        "call jax.distributed.initialize() first")
  name = f"jax_comm_gemm/nccl_unique_id/{key:016x}"
  if is_leader:
    unique_id = make_id()
    client.key_value_set(name, unique_id.hex())
    return unique_id
  return bytes.fromhex(client.blocking_key_value_get(name, int(timeout_s * 1000)))


class Registry:
  """See the module docstring. Thread-safe; a single instance, ``REGISTRY``."""

  def __init__(self):
    self._lock = threading.RLock()  # bind_axis asks cublasmp_status under it
    self._self_test_lock = threading.Lock()
    self._native: ModuleType | None = None
    self._status: Capability | None = None
    self._groups: set[int] = set()
    self._bound: set[int] = set()
    self._verdicts: dict[tuple, Capability] = {}

  # --- the extension and the library ----------------------------------------

  def cublasmp_status(self) -> Capability:
    """Whether the cuBLASMp backend can run in this process, and why not."""
    with self._lock:
      if self._status is None:
        self._status = self._load()
      return self._status

  def _load(self) -> Capability:
    if jax.default_backend() != "gpu":
      return Capability(False, f"the default JAX backend is {jax.default_backend()!r}, not GPU")
    native, reason = _native.load()
    if native is None:
      return Capability(False, reason)
    version = native.cublasmp_version()
    if version == 0:
      return Capability(False, "cuBLASMp loaded but reported no version")
    for name, handler in native.handlers().items():
      jax.ffi.register_ffi_target(name, handler, platform="CUDA")
    self._native = native
    return Capability(True, f"cuBLASMp {_version_text(version)}, NCCL "
                            f"{_version_text(native.nccl_version())}")

  def native(self) -> ModuleType:
    status = self.cublasmp_status()
    if self._native is None:
      raise RuntimeError(f"the cuBLASMp backend is unavailable: {status.reason}")
    return self._native

  def cublasmp_version(self) -> int:
    """major*10000 + minor*100 + patch, or 0 where cuBLASMp cannot run."""
    return self.native().cublasmp_version() if self.cublasmp_status().ok else 0

  def default_layout(self) -> str:
    return "front" if self.cublasmp_version() >= FRONT_LAYOUT_SINCE else "tail"

  # --- communicators ------------------------------------------------------------

  def fence(self) -> str:
    """The fence new contexts take: $JAX_COMM_GEMM_FENCE, else the default."""
    fences = list(self.native().fences())
    value = os.environ.get(ENV_FENCE, "")
    if value and value not in fences:
      raise ValueError(f"{ENV_FENCE}={value!r} is not a fence; use one of {', '.join(fences)} "
                       f"(or leave it unset for {fences[0]!r})")
    return value or fences[0]

  def bind_axis(self, mesh: Mesh, axis_name: str) -> int:
    """Sets up the communicators of the groups that `axis_name` forms in `mesh`
    (collective over the processes that hold them) and returns their comm_id."""
    fence = self.fence()  # a bad value fails here, before any collective set-up
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    comm_id = stable_key(("axis", tuple(tuple(d.id for d in g) for g in groups)))
    with self._lock:
      if comm_id in self._bound:
        return comm_id
      native = self.native()
      timeout = float(os.environ.get(ENV_CONNECT_TIMEOUT, "300"))
      me = jax.process_index()
      new_groups, device_groups = [], []
      for group in groups:
        local = [(int(d.local_hardware_id), rank) for rank, d in enumerate(group)
                 if d.process_index == me]
        if not local:
          continue
        key = stable_key(("group", tuple(d.id for d in group)))
        device_groups += [(device, key) for device, _ in local]
        if key not in self._groups:
          unique_id = exchange_unique_id(key, group[0].process_index == me,
                                         native.nccl_unique_id, timeout)
          new_groups.append((key, unique_id, len(group), local))
      if new_groups:
        native.connect(new_groups, fence, timeout)
        self._groups.update(g[0] for g in new_groups)
      native.bind(comm_id, device_groups)
      self._bound.add(comm_id)
      return comm_id

  def contexts(self) -> list[dict]:
    """One dict per context on this process (device, rank, workspace bytes...)."""
    return self._native.contexts() if self._native is not None else []

  def shutdown(self, timeout_s: float = 60.0) -> None:
    """Destroys all contexts (at exit); collective, so all processes do it."""
    with self._lock:
      if self._native is not None and not self._native.shutdown(timeout_s):
        warnings.warn("jax_comm_gemm: releasing the cuBLASMp contexts timed out "
                      f"after {timeout_s} s; leaving them to process exit")
      self._groups.clear()
      self._bound.clear()

  # --- capability ------------------------------------------------------------

  def gathered_reuse(self, axis_size: int, algorithm: str, dtype,
                     layout: str | None = None) -> Capability:
    """May a weight gradient reuse the operand a fused AllGather+GEMM gathered?"""
    dtype = jnp.dtype(dtype)
    status = self.cublasmp_status()
    if not status.ok:
      return status
    layout = layout or self.default_layout()
    key = (axis_size, algorithm, dtype.name, layout)
    with self._self_test_lock:  # one self-test at a time: each is collective
      with self._lock:
        if key in self._verdicts:
          return self._verdicts[key]
      verdict = self._self_test(axis_size, algorithm, dtype, layout)
      with self._lock:
        self._verdicts[key] = verdict
    if not verdict.ok:
      warnings.warn(
          f"jax_comm_gemm: not reusing cuBLASMp's gathered operand ({verdict.reason}); "
          "weight gradients all-gather with lax.all_gather instead", RuntimeWarning,
          stacklevel=2)
    return verdict

  def _self_test(self, axis_size, algorithm, dtype, layout) -> Capability:
    version = _version_text(self.cublasmp_version())
    devices = jax.devices()
    if len(devices) % axis_size:
      return Capability(False, f"the layout self-test needs groups of {axis_size} "
                               f"among {len(devices)} devices")
    mesh = Mesh(np.asarray(devices).reshape(-1, axis_size), ("jcg_groups", "jcg_tp"))
    # On a thread of its own, the probe runs outside the caller's trace (and its
    # mesh context), as a program of its own.
    outcome = {}

    def run():
      try:
        outcome["passed"] = _layout_probe(mesh, ALGORITHMS[algorithm], dtype, layout)
      except Exception as e:  # noqa: BLE001  (once per key, at trace time)
        outcome["error"] = e

    thread = threading.Thread(target=run, name="jax_comm_gemm-self-test")
    thread.start()
    thread.join()
    if "error" in outcome:
      return Capability(False, f"the layout self-test could not run on cuBLASMp "
                               f"{version}: {outcome['error']}")
    passed = outcome["passed"]
    if not passed:
      return Capability(False, f"cuBLASMp {version} does not leave the gathered operand "
                               f"where the {layout!r} layout says (self-test, "
                               f"{algorithm}, {dtype.name})")
    return Capability(True, f"cuBLASMp {version}, {layout!r} layout verified by self-test")


def _layout_probe(mesh: Mesh, algorithm: int, dtype, layout: str) -> bool:
  """Runs small fused AllGather+GEMMs on every device and checks that the
  operand they expose equals lax.all_gather's, bit for bit, everywhere."""
  from jax_comm_gemm import ffi_ops, vma  # noqa: PLC0415  (cycle)

  axes = ("jcg_groups", "jcg_tp")

  def body():
    rank = lax.axis_index("jcg_tp")
    ok = jnp.bool_(True)
    for rows, features, outputs in PROBE_SHAPES:
      i = lax.broadcasted_iota(jnp.int32, (rows, features), 0) + rank * rows
      j = lax.broadcasted_iota(jnp.int32, (rows, features), 1)
      x = ((i * 31 + j * 7) % 61 - 30).astype(dtype)  # small integers: exact in bf16
      w = (lax.broadcasted_iota(jnp.int32, (features, outputs), 0) % 5 - 2).astype(dtype)
      _, gathered = ffi_ops.all_gather_matmul(
          x, w, "jcg_tp", transpose_w=False, return_gathered=True, algorithm=algorithm,
          layout=layout)
      expected = lax.all_gather(x, "jcg_tp", axis=0, tiled=True)
      ok = ok & jnp.array_equal(gathered, expected)
    return lax.pmin(vma.pvary(ok.astype(jnp.int32), axes), axes)

  probe = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P()))
  return bool(np.asarray(probe().addressable_data(0)))


def _version_text(version: int) -> str:
  """cuBLASMp and NCCL (since 2.9) both encode major*10000 + minor*100 + patch."""
  return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


REGISTRY = Registry()
atexit.register(REGISTRY.shutdown)
