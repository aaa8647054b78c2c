"""The fused FP8 comm-GEMMs (xla_ffi/context.h) on a group of one GPU: what one
GPU can check of them. With one rank nothing travels, so these check the FP8
GEMM each algorithm runs (the operand types, the TN form, the scale pointers,
fast accumulation, the timed pick) and the gathered FP8 operand it hands out,
against float64 per row; the transfers are the bf16 ops' (bytes) and are
checked on two GPUs (tests/gpu/checks.py).

A group of one is made directly on the extension (``connect`` makes none: the
layers run a plain GEMM there), and the ops are called as primitives. Each
algorithm runs bf16 beside FP8: one that does not run on a group of one at
all (bf16 neither) is reported, not failed. Run by one_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_comm_gemm.backends.primitives as primitives
from jax_comm_gemm.fp8 import quantize_tensor
from jax_comm_gemm.runtime import REGISTRY, comm_id
from jax_comm_gemm.runtime.capability import default_layout
from jax_comm_gemm.runtime.constants import ALGORITHMS, REDUCE_SCATTER_ALGORITHMS, TARGETS

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
GROUP_KEY = 0x4F4E4552414E4B  # any key no mesh axis hashes to
# Per-row error allowed against float64 of the dequantized operands: the
# output's rounding and the tensor cores' accumulation (one_gpu.py measures it).
TOL = {True: 2.0 ** -8 + 3e-2, False: 2.0 ** -8 + 2e-3}


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _connect_one(mesh) -> None:
  """A context of one rank on device 0, bound to the mesh axis's comm_id."""
  native = REGISTRY.native()
  if any(c["group"] == GROUP_KEY for c in native.contexts()):
    return
  native.connect([(GROUP_KEY, native.nccl_unique_id(), 1, [(0, 0)])], 60.0, 60.0, True)
  native.bind(comm_id(mesh, "tp"), [(0, GROUP_KEY)])


def _layout() -> str:
  return default_layout(REGISTRY.cublasmp_version())


def _row_error(got, ref) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return float(np.max(np.abs(got - ref).max(1) / np.maximum(np.abs(ref).max(1), 1e-30)))


def _operands(n, k, m, dx, seed):
  ka, kb = jax.random.split(jax.random.key(seed))
  # Rows of very different magnitudes: a scale missing or applied twice shows.
  x = jax.random.normal(ka, (n, k)) * jnp.exp2(jnp.arange(n) % 5)[:, None] * 3
  w = jax.random.normal(kb, (m, k)) / 7
  (x8, xi), (w8, wi) = quantize_tensor(x, dx), quantize_tensor(w, E4)
  ref = (np.asarray(x8.astype(jnp.float32), np.float64) * float(xi)) @ (
      np.asarray(w8.astype(jnp.float32), np.float64) * float(wi)).T
  return x8, w8, xi, wi, ref


def _run(mesh, f, *args):
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                            check_vma=False))
  return jax.block_until_ready(g(*args))


def _runs_bf16(mesh, op, algorithm) -> str | None:
  """None if `algorithm` runs `op` in bf16 on a group of one; else why not."""
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((64, 128), jnp.bfloat16)
  try:
    if op == "ag":
      _run(mesh, lambda x, w: primitives.all_gather_matmul(
          x, w, "tp", transpose_w=True, return_gathered=True,
          algorithm=ALGORITHMS[algorithm], layout=_layout())[0], x, w)
    else:
      _run(mesh, lambda x, w: primitives.matmul_reduce_scatter(
          x, w, "tp", transpose_w=True, algorithm=ALGORITHMS[algorithm]), x, w)
  except Exception as e:  # noqa: BLE001  (a check, once)
    return f"{type(e).__name__}: {str(e)[:160]}"
  return None


def _check_scales_follow_the_call(mesh, algorithm, op):
  """The plan made at a call is reused by the next of its shapes: those
  calls' scales (other buffers, other values) must be the ones applied."""
  x8, w8, xi, wi, ref = _operands(128, 256, 128, E4, 11)
  for factor in (1.0, 4.0, 0.5):
    args = (x8, w8, xi * factor, wi)
    if op == "ag":
      y = _run(mesh, lambda *a: primitives.fp8_all_gather_matmul(
          *a, "tp", out_dtype=jnp.float32, return_gathered=True,
          algorithm=ALGORITHMS[algorithm], layout=_layout(), fast_accum=True), *args)[0]
    else:
      y = _run(mesh, lambda *a: primitives.fp8_matmul_reduce_scatter(
          *a, "tp", out_dtype=jnp.float32, algorithm=ALGORITHMS[algorithm],
          fast_accum=True), *args)
    err = _row_error(y, ref * factor)
    assert err <= TOL[True], f"{algorithm} {op}, scale x{factor}: {err:.3g}"


def check_fused_fp8_all_gather_one_rank():
  """Every AllGather+GEMM algorithm in FP8 (E4M3 and E5M2 x, E4M3 w), bf16
  and f32 out, fast accumulation and not: y per row against float64, the
  gathered FP8 operand bit-equal to x8, and each call's own scales applied."""
  mesh = _mesh()
  _connect_one(mesh)
  notes = []
  for algorithm in ALGORITHMS:
    why = _runs_bf16(mesh, "ag", algorithm)
    if why is not None:
      notes.append(f"{algorithm}: not on a group of one ({why})")
      continue
    worst = 0.0
    for n, k, m in ((256, 512, 384), (208, 1024, 272)):
      for dx in (E4, E5):
        x8, w8, xi, wi, ref = _operands(n, k, m, dx, n + k)
        for out in (jnp.bfloat16, jnp.float32):
          for fast in (True, False):
            y, g8 = _run(mesh, lambda *a: primitives.fp8_all_gather_matmul(
                *a, "tp", out_dtype=out, return_gathered=True,
                algorithm=ALGORITHMS[algorithm], layout=_layout(), fast_accum=fast),
                x8, w8, xi, wi)
            assert y.dtype == out and y.shape == (n, m), (y.dtype, y.shape)
            err = _row_error(y, ref)
            assert err <= TOL[fast], (f"{algorithm} {n}x{k}x{m} {jnp.dtype(dx).name} "
                                      f"{jnp.dtype(out).name} fast={fast}: {err:.3g}")
            worst = max(worst, err)
            same = np.array_equal(np.asarray(jax.lax.bitcast_convert_type(g8, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(x8, jnp.uint8)))
            assert same, f"{algorithm}: the gathered FP8 operand is not x8"
    _check_scales_follow_the_call(mesh, algorithm, "ag")
    notes.append(f"{algorithm}: worst per-row error {worst:.2e}")
  assert any("worst" in note for note in notes), notes
  return "; ".join(notes)


def check_fused_fp8_reduce_scatter_one_rank():
  """cuBLASMp's GEMM+ReduceScatter algorithms in FP8 (E5M2 x E4M3, as fc1's
  dgrad) per row against float64. pipelined_ce is left out: it sends its
  blocks to the peers and adds theirs, so it needs two ranks."""
  mesh = _mesh()
  _connect_one(mesh)
  notes = []
  for algorithm in (a for a in REDUCE_SCATTER_ALGORITHMS if a != "pipelined_ce"):
    why = _runs_bf16(mesh, "rs", algorithm)
    if why is not None:
      notes.append(f"{algorithm}: not on a group of one ({why})")
      continue
    x8, w8, xi, wi, ref = _operands(256, 512, 384, E5, 9)
    y = _run(mesh, lambda *a: primitives.fp8_matmul_reduce_scatter(
        *a, "tp", out_dtype=jnp.bfloat16, algorithm=ALGORITHMS[algorithm],
        fast_accum=True), x8, w8, xi, wi)
    err = _row_error(y, ref)
    assert err <= TOL[True], f"{algorithm}: {err:.3g}"
    _check_scales_follow_the_call(mesh, algorithm, "rs")
    notes.append(f"{algorithm}: per-row error {err:.2e}")
  return "; ".join(notes)


def check_fused_fp8_error_reaches_python():
  """An FP8 call with w not in the TN form is refused with the handler's words."""
  mesh = _mesh()
  _connect_one(mesh)
  x8, w8, xi, wi, _ = _operands(64, 128, 64, E4, 1)
  call = jax.ffi.ffi_call(TARGETS["fp8_all_gather_matmul"],
                          jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))
  try:
    _run(mesh, lambda *a: call(*a, comm_id=np.int64(comm_id(mesh, "tp")),
                               algorithm=np.int64(ALGORITHMS["pipelined_ce"]),
                               transpose_w=False, fast_accum=True, layout=np.int64(0)),
         x8, w8.T, xi, wi)
  except Exception as e:  # XlaRuntimeError (its module moved between jax versions)
    assert "takes w as [features, k] (transpose_w)" in str(e), str(e)
    return f"{type(e).__name__}: ...{str(e)[-70:]}"
  raise AssertionError("an FP8 w in the NN form was not refused")


CHECKS = [check_fused_fp8_all_gather_one_rank, check_fused_fp8_reduce_scatter_one_rank,
          check_fused_fp8_error_reaches_python]
