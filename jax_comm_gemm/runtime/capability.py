"""May a weight gradient take the operand that a fused AllGather+GEMM left in
cuBLASMp's workspace? The verdict, and the self-test behind it: ``connect``
runs small AllGather+GEMMs on a known pattern for every (algorithm, dtype,
transpose) the layers may ask for, at an aligned shape and one that is not,
and compares the exposed operand with ``lax.all_gather``'s bit for bit. The
custom_vjps only read the cached verdicts."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_comm_gemm.runtime.constants import (ALGORITHMS, GATHERED_LAYOUTS, OWN_ALGORITHMS,
                                             TARGETS)


@dataclasses.dataclass(frozen=True)
class Capability:
  """Whether something can run here, and why (not).

  >>> Capability(False, "no GPU").reason
  'no GPU'
  """
  ok: bool
  reason: str


@dataclasses.dataclass(frozen=True)
class VerdictKey:
  """What the layout of the gathered operand may depend on."""
  axis_size: int
  algorithm: str
  dtype: str
  transpose_w: bool
  layout: str


@dataclasses.dataclass(frozen=True)
class WorkspaceKey:
  """Whether cuBLASMp got its workspace on groups of `axis_size` (connect's probe),
  kept beside the layout verdicts and keyed by group size as they are."""
  axis_size: int


@dataclasses.dataclass(frozen=True)
class Workspace(Capability):
  """connect's verdict on cuBLASMp's workspace: `ok` where cuBLASMp has one;
  `plain` where NCCL has no symmetric memory and the workspace is plain device
  memory (cuBLASMp's default runs there without overlap; split_p2p does not).

  >>> workspace_verdict(2, "not supported", plain=True).plain
  True
  """
  plain: bool = False


# cuBLASMp's own algorithms: they need its workspace.
CUBLASMP_ALGORITHMS = tuple(a for a in ALGORITHMS if a not in OWN_ALGORITHMS)
# What a plain workspace leaves to cuBLASMp's default (the mode's name in verdicts).
PLAIN_WORKSPACE = "no NCCL symmetric memory: cuBLASMp's default runs without overlap"
# cuBLASMp's algorithms that need symmetric memory: on a plain workspace
# cublasMpMatmul returns NOT_SUPPORTED for them (docs/design.md#the-plain-workspace-mode).
SYMMETRIC_ONLY_ALGORITHMS = ("split_p2p",)


def workspace_verdict(axis_size: int, error: str, plain: bool = False) -> Workspace:
  """The verdict of connect's workspace probe on groups of `axis_size`
  (`error`: the library's refusal of cublasMpMalloc, "" where it got one;
  `plain`: every context then took a plain workspace instead)."""
  if not error:
    return Workspace(True, f"cuBLASMp got its workspace on groups of {axis_size}")
  if plain:
    return Workspace(True, f"{PLAIN_WORKSPACE} on groups of {axis_size} (cublasMpMalloc: "
                           f"{error}; the workspace is plain device memory, so "
                           f"{' and '.join(map(repr, SYMMETRIC_ONLY_ALGORITHMS))} and jax's "
                           "Pallas kernel cannot run there)", plain=True)
  return Workspace(False, f"cuBLASMp cannot get its workspace on groups of {axis_size} "
                          f"({error}; NCCL symmetric memory is unavailable, as where ranks "
                          f"share a GPU or GPUs lack peer access), so its algorithms "
                          f"{' and '.join(map(repr, CUBLASMP_ALGORITHMS))} cannot run there")


def symmetric_memory(workspace: Capability) -> bool:
  """Whether the group of `workspace` (connect's verdict) has NCCL symmetric memory."""
  return workspace.ok and not getattr(workspace, "plain", False)


def algorithm_refusal(algorithm: str, workspace: Capability) -> str | None:
  """Why cuBLASMp's `algorithm` cannot run where connect found `workspace`,
  or None where it can (the project's own algorithms always can).

  >>> algorithm_refusal("default", workspace_verdict(2, "not supported", plain=True)) is None
  True
  >>> algorithm_refusal("split_p2p", workspace_verdict(2, "not supported", plain=True))[:38]
  "cuBLASMp refuses 'split_p2p' on a plai"
  """
  if algorithm not in CUBLASMP_ALGORITHMS:
    return None
  if not workspace.ok:
    return workspace.reason
  if getattr(workspace, "plain", False) and algorithm in SYMMETRIC_ONLY_ALGORITHMS:
    return (f"cuBLASMp refuses {algorithm!r} on a plain workspace (NOT_SUPPORTED): "
            f"{workspace.reason}")
  return None


def cublasmp_refusal(fused, workspace: Capability, asked: str) -> str | None:
  """Why `fused` (a config or backend with ``all_gather_algorithm`` and
  ``reduce_scatter``), required by `asked`, cannot run where `workspace`
  refused cuBLASMp's; None where it can.

  >>> import types
  >>> fused = types.SimpleNamespace(all_gather_algorithm="pipelined_ce", reduce_scatter="xla")
  >>> cublasmp_refusal(fused, workspace_verdict(2, "refused"), "backend='cublasmp'") is None
  True
  """
  refused = {field: algorithm_refusal(getattr(fused, field), workspace)
             for field in ("all_gather_algorithm", "reduce_scatter")}
  named = [f"{field}={getattr(fused, field)!r}" for field, why in refused.items() if why]
  if not named:
    return None
  why = next(why for why in refused.values() if why)
  other = ("all_gather_algorithm='default', reduce_scatter='default' or "
           if workspace.ok else "")
  return (f"{asked} with {' and '.join(named)}: {why}. These run here: "
          f"CommGemmConfig({other}all_gather_algorithm='pipelined_ce', "
          "reduce_scatter='pipelined_ce'), or backend='auto'")


# cuBLASMp 0.11.0 documents the gathered B at the start of its workspace; 0.10
# leaves it at the tail (measured: docs/design.md#the-gathered-operand-and-its-layout).
FRONT_LAYOUT_SINCE = 1100
# Every AllGather+GEMM algorithm the project offers may hand out its operand.
SELF_TESTED_ALGORITHMS = tuple(ALGORITHMS)
SELF_TESTED_DTYPES = ("bfloat16", "float16", "float32")
# The FP8 ops' operand types (xla_ffi/context.h), in their one form: w as
# [features, k] (TN), the gathered x FP8 bytes.
SELF_TESTED_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# (local tokens, features, local outputs): aligned, and not a multiple of 128
# (FP8: of 16, as its GEMMs need).
PROBE_SHAPES = ((256, 1024, 512), (200, 520, 264))
FP8_PROBE_SHAPES = ((256, 1024, 512), (200, 528, 272))


def default_layout(cublasmp_version: int) -> str:
  return "front" if cublasmp_version >= FRONT_LAYOUT_SINCE else "tail"


def version_text(version: int) -> str:
  """cuBLASMp and NCCL (since 2.9) both encode major*10000 + minor*100 + patch."""
  return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def untested(key: VerdictKey | WorkspaceKey) -> Capability:
  if isinstance(key, WorkspaceKey):  # no connect probed it: nothing refused
    return Capability(True, f"no workspace probe on groups of {key.axis_size}")
  return Capability(False, f"reuse not verified for {key.algorithm}, {key.dtype}, "
                           f"{'TN' if key.transpose_w else 'NN'}, {key.layout!r} layout: "
                           "no self-test covered it (is the mesh axis connected?)")


def _pattern(rows: int, cols: int, row0, dtype):
  """Small integers, exact in every tested dtype, different in every row."""
  i = lax.broadcasted_iota(jnp.int32, (rows, cols), 0) + row0
  j = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
  return ((i * 31 + j * 7) % 61 - 30).astype(dtype)


def _cases(axis_size: int, layout: str):
  wide = [VerdictKey(axis_size, a, d, t, layout) for a in SELF_TESTED_ALGORITHMS
          for d in SELF_TESTED_DTYPES for t in (False, True)]
  fp8 = [VerdictKey(axis_size, a, d, True, layout) for a in SELF_TESTED_ALGORITHMS
         for d in SELF_TESTED_FP8_DTYPES]
  return wide + fp8


def _gathered(case: VerdictKey, x, w, axis_size: int, comm_id: int, layout: str):
  """The gathered x that the op of `case` hands out, in x's dtype."""
  rows, features = x.shape
  outputs = w.shape[0] if case.transpose_w else w.shape[1]
  attributes = dict(comm_id=np.int64(comm_id), algorithm=np.int64(ALGORITHMS[case.algorithm]),
                    transpose_w=case.transpose_w, layout=np.int64(GATHERED_LAYOUTS[layout]))
  fp8 = case.dtype in SELF_TESTED_FP8_DTYPES
  results = (jax.ShapeDtypeStruct((rows * axis_size, outputs),
                                  jnp.bfloat16 if fp8 else x.dtype),
             jax.ShapeDtypeStruct((rows * axis_size, features), x.dtype))
  if fp8:  # w E4M3 (an E5M2 x takes an E4M3 w), unit scales
    one = jnp.ones((), jnp.float32)
    call = jax.ffi.ffi_call(TARGETS["fp8_all_gather_matmul"], results)
    return call(x, w, one, one, fast_accum=True, **attributes)[1]
  return jax.ffi.ffi_call(TARGETS["all_gather_matmul"], results)(x, w, **attributes)[1]


def self_test(mesh, axis_name: str, comm_id: int, layout: str, version: int,
              workspace: Capability) -> dict[VerdictKey, Capability]:
  """Runs the probe for `layout` on every device of `mesh` (collective) and
  returns a verdict per case: one program per algorithm, and where one fails,
  one per case, so that a refused case does not condemn the others. cuBLASMp's
  algorithms do not run where `workspace` refuses them (each such case's
  verdict says why); on a plain workspace cuBLASMp's default is tested as on
  any other. Says once (a RuntimeWarning) which cases failed: those layers stay
  correct and gather their operand again, and the failure is worth a report."""
  verdicts, probed = {}, {}  # probed: the cases that ran, whose failure is worth a report
  cases = _cases(int(mesh.shape[axis_name]), layout)
  for algorithm in SELF_TESTED_ALGORITHMS:
    group = [c for c in cases if c.algorithm == algorithm]
    refused = algorithm_refusal(algorithm, workspace)
    if refused:
      verdicts.update(dict.fromkeys(group, Capability(False, refused)))
      continue
    found = _probe(mesh, axis_name, comm_id, layout, version, group)
    if all(not v.ok and "could not run" in v.reason for v in found.values()):
      for case in group:
        found.update(_probe(mesh, axis_name, comm_id, layout, version, [case]))
    verdicts.update(found)
    probed.update(found)
  failed = sorted({v.reason for v in probed.values() if not v.ok})
  if failed:
    warnings.warn("jax_comm_gemm: the layout self-test failed, so reuse of the gathered "
                  "operand is off there (the layers stay correct and gather it again); "
                  f"please report it with jcg.cublasmp_version()={version}: "
                  + "; ".join(failed), RuntimeWarning, stacklevel=2)
  return verdicts


def _probe(mesh, axis_name: str, comm_id: int, layout: str, version: int,
           cases) -> dict[VerdictKey, Capability]:
  axis_size = int(mesh.shape[axis_name])
  axes = tuple(mesh.axis_names)

  def body():
    rank = lax.axis_index(axis_name)
    oks = []
    for case in cases:
      dtype = jnp.dtype(case.dtype)
      fp8 = case.dtype in SELF_TESTED_FP8_DTYPES
      ok = jnp.bool_(True)
      for rows, features, outputs in FP8_PROBE_SHAPES if fp8 else PROBE_SHAPES:
        x = _pattern(rows, features, rank * rows, dtype)
        w_shape = (outputs, features) if case.transpose_w else (features, outputs)
        w = _pattern(*w_shape, 0, jnp.float8_e4m3fn if fp8 else dtype)
        gathered = _gathered(case, x, w, axis_size, comm_id, layout)
        expected = lax.all_gather(x, axis_name, axis=0, tiled=True)
        if fp8:  # bit for bit: compare the bytes
          gathered, expected = (lax.bitcast_convert_type(a, jnp.uint8)
                                for a in (gathered, expected))
        ok = ok & jnp.array_equal(gathered, expected)
      oks.append(ok.astype(jnp.int32))
    return lax.pmin(jnp.stack(oks), axes)

  probe = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(),
                                check_vma=False))
  text = version_text(version)
  try:
    passed = np.asarray(probe().addressable_data(0))
  except Exception as e:  # noqa: BLE001  (once per layout at connect, never per call)
    reason = f"the layout self-test could not run on cuBLASMp {text}: {e}"
    return {case: Capability(False, reason) for case in cases}
  return {case: (Capability(True, f"cuBLASMp {text}, {layout!r} layout verified by "
                                  "self-test")
                 if ok else
                 Capability(False, f"cuBLASMp {text} does not leave the gathered operand "
                                   f"where the {layout!r} layout says (self-test, "
                                   f"{case.algorithm}, {case.dtype}, "
                                   f"{'TN' if case.transpose_w else 'NN'})"))
          for case, ok in zip(cases, passed)}
