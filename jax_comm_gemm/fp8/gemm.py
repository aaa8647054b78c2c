"""The FP8 GEMM in the TN form (both operands contract on their last axis), the
one layout Hopper's FP8 GEMMs take: XLA compiles it to one cuBLASLt FP8 call
with no transpose in front, so the weight's FP8 copies are cast in the layout
each GEMM wants (:func:`weight_copies`). Two forms (``Fp8Recipe.gemm_form``):

* ``"direct"``: the dot of the FP8 operands, times the inverse scales (per
  tensor or per row: they factor out of the contraction);
* ``"cublaslt"``: the project's custom call (``xla_ffi/fp8_gemm.cc``), which
  applies the scales itself (per tensor, row or block) with a timed algorithm;
  ``"direct"`` runs where it cannot (no extension, dims not multiples of 16,
  two E5M2 operands). Measurements: docs/fp8.md.

>>> import jax.numpy as jnp
>>> from jax_comm_gemm.fp8.quantize import quantize_tensor
>>> a8, ia = quantize_tensor(jnp.ones((4, 8)), jnp.float8_e4m3fn)
>>> b8, ib = quantize_tensor(jnp.full((2, 8), 0.5), jnp.float8_e4m3fn)
>>> fp8_gemm_tn(a8, b8, ia, ib, jnp.float32).round(4).tolist()
[[4.0, 4.0], [4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_comm_gemm import validation, vma
from jax_comm_gemm.runtime.constants import TARGETS
from jax_comm_gemm.runtime.registry import REGISTRY
from jax_comm_gemm.fp8.cast import cast_transpose
from jax_comm_gemm.fp8.quantize import (BLOCK, amax, dequantize, inverse,
                                        quantize_blocks, quantize_columns_transposed,
                                        quantize_rows, scale_from_amax)

F32 = jnp.float32
TN = (((1,), (1,)), ((), ()))


def fp8_gemm_tn(a8, b8, scale_inv_a, scale_inv_b, out_dtype, *, form: str = "direct",
                fast_accum: bool = True):
  """``(a8 @ b8.T) * scale_inv_a * scale_inv_b`` in `out_dtype`, a8 ``[m, k]``
  and b8 ``[n, k]`` FP8 (both contract on their last axis). Scales are scalars,
  vectors (``[m]`` per row of a, ``[n]`` per row of b), or blocks
  (:func:`~jax_comm_gemm.fp8.quantize.quantize_blocks`), which XLA has no FP8
  GEMM for: they run on the custom call ("cublaslt"), elsewhere as a float32
  GEMM of the dequantized operands. `fast_accum`: Hopper's FP8 fast
  accumulation (XLA's default for an FP8 dot); False promotes the partial sums
  to f32. Block scales always accumulate in f32.

  >>> a8 = jnp.ones((2, 4), jnp.float8_e4m3fn)
  >>> fp8_gemm_tn(a8, a8, 0.5, jnp.array([1.0, 2.0]), jnp.float32).tolist()
  [[2.0, 4.0], [2.0, 4.0]]
  """
  fast_accum = validation.check_flag("fp8_gemm_tn", "fast_accum", fast_accum)
  out_dtype = jnp.dtype(out_dtype)
  ia, ib = jnp.asarray(scale_inv_a, F32), jnp.asarray(scale_inv_b, F32)
  if form not in ("direct", "cublaslt"):
    raise ValueError(f"fp8_gemm_tn: form must be 'direct' or 'cublaslt', got {form!r}")
  blocks = ia.ndim == 2 or ib.ndim == 2
  if form == "cublaslt":
    if _cublaslt_takes(a8, b8, ia, ib):
      return cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=out_dtype,
                              fast_accum=fast_accum and not blocks)
    form = "direct"
  if blocks:  # XLA's emulation: the dequantized operands' float32 GEMM
    return lax.dot_general(dequantize(a8, ia), dequantize(b8, ib), TN,
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=F32).astype(out_dtype)
  precision = None if fast_accum else lax.Precision.HIGHEST
  return _direct(a8, b8, ia, ib, out_dtype, precision)


def _direct(a8, b8, ia, ib, out_dtype, precision=None):
  """The "direct" form: the FP8 dot, then the scales on its output."""
  acc = out_dtype if out_dtype == jnp.dtype(jnp.bfloat16) else jnp.dtype(F32)
  y = lax.dot_general(a8, b8, TN, precision=precision, preferred_element_type=acc)
  if ia.ndim == 0 and ib.ndim == 0:
    return (y * (ia * ib).astype(acc)).astype(out_dtype)
  ia = ia[:, None] if ia.ndim else ia
  return (y.astype(F32) * ia * ib).astype(out_dtype)


# --- the "cublaslt" form: the project's FP8 GEMM custom call --------------------

E5M2 = jnp.dtype(jnp.float8_e5m2)


def _cublaslt_takes(a8, b8, ia, ib) -> bool:
  """Whether the custom call takes these operands (else the "direct" form).
  cuBLASLt's FP8 GEMMs want 16-byte aligned leading dimensions (k for both
  FP8 operands, n for the output) and at least one E4M3 operand; the scales
  are two scalars, two vectors (per row of a and of b), or blocks of each
  (1 x 128 or 128 x 128, over dims that 128 divides)."""
  m, k = a8.shape
  n = b8.shape[0]
  modes = (_scale_mode(ia, m, k), _scale_mode(ib, n, k))
  scales = (modes in ((SCALAR, SCALAR), (OUTER_VEC, OUTER_VEC))
            or set(modes) <= {VEC128, BLK128})
  return (scales and k % 16 == 0 and n % 16 == 0 and min(m, n, k) > 0
          and not (a8.dtype == E5M2 and b8.dtype == E5M2))


# cuBLASLt's scale modes (cublasLtMatmulMatrixScale_t), as the custom call's
# attributes name them.
SCALAR, OUTER_VEC, VEC128, BLK128 = 0, 3, 4, 5


def _scale_mode(inv, rows: int, k: int):
  """The cuBLASLt mode of an operand's scales (rows x k), or None."""
  if inv.ndim == 0:
    return SCALAR
  if inv.shape == (rows,):
    return OUTER_VEC
  if k % BLOCK == 0 and inv.shape == (rows, k // BLOCK):
    return VEC128
  if k % BLOCK == 0 and rows % BLOCK == 0 and inv.shape == (rows // BLOCK, k // BLOCK):
    return BLK128
  return None


def _cublaslt_scales(inv, mode):
  """`inv` in the layout cuBLASLt reads for `mode`: 1 x 128 scales with the
  rows fastest ([k/128, rows]); 128 x 128 scales with the k blocks fastest,
  padded to a multiple of 4 ([rows/128, round_up(k/128, 4)])."""
  if mode == VEC128:
    return inv.T
  if mode == BLK128:
    return jnp.pad(inv, ((0, 0), (0, -inv.shape[1] % 4)))
  return inv


def _from_cublaslt_scales(inv, mode, k: int):
  """:func:`_cublaslt_scales` undone: `inv` back in the layout of
  :func:`~jax_comm_gemm.fp8.quantize.quantize_blocks`."""
  if mode == VEC128:
    return inv.T
  if mode == BLK128:
    return inv[:, :k // BLOCK]
  return inv


def _fp8_gemm_abstract(a8, b8, sa, sb, *, out_dtype, timed, fast_accum, modes):
  del sa, sb, timed, fast_accum, modes
  return a8.update(shape=(a8.shape[0], b8.shape[0]), dtype=out_dtype, weak_type=False)


def _fp8_gemm_elsewhere(a8, b8, sa, sb, *, out_dtype, timed, fast_accum, modes):
  del timed
  if set(modes) & {VEC128, BLK128}:
    k = a8.shape[1]
    sa, sb = (_from_cublaslt_scales(s, m, k) for s, m in zip((sa, sb), modes))
    return fp8_gemm_tn(a8, b8, sa, sb, out_dtype, form="direct")
  return _direct(a8, b8, sa, sb, out_dtype, None if fast_accum else lax.Precision.HIGHEST)


_lower_elsewhere = mlir.lower_fun(_fp8_gemm_elsewhere, multiple_results=False)


def _fp8_gemm_cuda(ctx, a8, b8, sa, sb, *, out_dtype, timed, fast_accum, modes):
  # The handler is registered with the extension (runtime/registry.py); a
  # process without it compiles XLA's form instead, as on other platforms.
  if not REGISTRY.cublasmp_status().ok:
    return _lower_elsewhere(ctx, a8, b8, sa, sb, out_dtype=out_dtype, timed=timed,
                            fast_accum=fast_accum, modes=modes)
  return jax.ffi.ffi_lowering(_FP8_GEMM_TARGET)(
      ctx, a8, b8, sa, sb, timed=bool(timed), fast_accum=bool(fast_accum),
      a_scale_mode=np.int32(modes[0]), b_scale_mode=np.int32(modes[1]))


def _fp8_gemm_batched(args, dims, **params):
  """The batching rule of ``a8 [m, k] . b8 [n, k]^T``: a batch of a alone (b
  shared) folds into a's rows where its scales fold with them (one shared
  scalar, or per row); any other batch runs one TN GEMM per element."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  a8, b8, sa, sb = args
  da, db, dsa, dsb = dims
  mode_a = params["modes"][0]
  if (db is dsb is None and da is not None
      and (mode_a == OUTER_VEC or (mode_a == SCALAR and dsa is None))):
    m = a8.shape[1 if da == 0 else 0]
    a8 = jnp.moveaxis(a8, da, 0).reshape(size * m, -1)
    if mode_a == OUTER_VEC:  # per-row scales follow their rows
      sa = jnp.tile(sa, size) if dsa is None else jnp.moveaxis(sa, dsa, 0).reshape(-1)
    return _fp8_gemm_p.bind(a8, b8, sa, sb, **params).reshape(size, m, -1), 0
  mapped = [i for i, d in enumerate(dims) if d is not None]

  def one(xs):
    operands = list(args)
    for i, x in zip(mapped, xs):
      operands[i] = x
    return _fp8_gemm_p.bind(*operands, **params)

  return lax.map(one, tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped)), 0


_FP8_GEMM_TARGET = TARGETS["fp8_gemm"]
_fp8_gemm_p = Primitive(_FP8_GEMM_TARGET)
_fp8_gemm_p.def_abstract_eval(_fp8_gemm_abstract)
batching.primitive_batchers[_fp8_gemm_p] = _fp8_gemm_batched
mlir.register_lowering(_fp8_gemm_p, _fp8_gemm_cuda, platform="cuda")
mlir.register_lowering(_fp8_gemm_p, _lower_elsewhere)


@partial(jax.jit, static_argnames=("out_dtype", "timed", "fast_accum"))
def cublaslt_gemm_tn(a8, b8, scale_inv_a, scale_inv_b, *, out_dtype, timed: bool = True,
                     fast_accum: bool = True):
  """The project's FP8 GEMM custom call itself: ``(a8 @ b8.T) * scales`` as
  :func:`fp8_gemm_tn` with ``form="cublaslt"``, without its checks of what the
  call takes (:func:`_cublaslt_takes`). `timed=False` takes cuBLASLt's first
  heuristic algorithm instead of the fastest timed one. Jitted, so it also
  runs eagerly; on a platform other than CUDA it compiles the "direct" form.

  >>> a8 = jnp.ones((16, 32), jnp.float8_e4m3fn)
  >>> cublaslt_gemm_tn(a8, a8, jnp.float32(0.5), jnp.float32(0.25),
  ...                  out_dtype=jnp.float32)[0, :2].tolist()
  [4.0, 4.0]
  """
  timed = validation.check_flag("cublaslt_gemm_tn", "timed", timed)
  fast_accum = validation.check_flag("cublaslt_gemm_tn", "fast_accum", fast_accum)
  a8, b8, sa, sb = vma.match(a8, b8, jnp.asarray(scale_inv_a, F32),
                             jnp.asarray(scale_inv_b, F32))
  k = a8.shape[1]
  modes = (_scale_mode(sa, a8.shape[0], k), _scale_mode(sb, b8.shape[0], k))
  if None in modes:
    raise ValueError(f"cublaslt_gemm_tn: scales of shapes {sa.shape} and {sb.shape} fit "
                     f"none of cuBLASLt's modes for a {a8.shape} and b {b8.shape}")
  sa, sb = (_cublaslt_scales(s, m) for s, m in zip((sa, sb), modes))
  return _fp8_gemm_p.bind(a8, b8, sa, sb, out_dtype=jnp.dtype(out_dtype), timed=timed,
                          fast_accum=fast_accum, modes=modes)


def weight_copies(w, dtype, *, scaling: str, transpose_w: bool, margin: int = 0,
                  axis_name: str | None = None, amax_w=None, casts: str = "auto",
                  with_amax: bool = False):
  """The weight's two FP8 copies, made by one cast: ``(fwd8, fwd_inv, bwd8,
  bwd_inv)``, then with `with_amax` (``"tensor"`` only) w's amax from the same
  pass (delayed scaling's history records it). For ``y = x @ w`` (w ``[k, n]``;
  ``[n, k]`` with `transpose_w`) ``fwd8`` ``[n, k]`` feeds the forward GEMM and
  ``bwd8`` ``[k, n]`` the input gradient's. ``"tensor"``: one scale for both (agreed over `axis_name`, or
  `amax_w` already agreed); ``"row"``: per row of each copy; ``"block"``: per
  128 x 128 block, the second copy the first's transpose. `casts`: the
  implementation of ``"tensor"``'s one pass (:func:`~jax_comm_gemm.fp8.cast.cast_transpose`).

  >>> fwd8, fwd_inv, bwd8, bwd_inv = weight_copies(jnp.ones((4, 3)), jnp.float8_e4m3fn,
  ...                                              scaling="row", transpose_w=False)
  >>> fwd8.shape, fwd_inv.shape, bwd8.shape, bwd_inv.shape
  ((3, 4), (3,), (4, 3), (4,))
  """
  transpose_w = validation.check_flag("weight_copies", "transpose_w", transpose_w)
  with_amax = validation.check_flag("weight_copies", "with_amax", with_amax)
  w_kn = w.T if transpose_w else w
  if scaling == "tensor":
    if amax_w is None:
      amax_w = amax(w_kn, axis_name=axis_name)
    scale = scale_from_amax(amax_w, dtype, margin)
    inv = inverse(scale)
    # Both copies from the high-precision weight in one pass: no FP8 transpose.
    bwd8, fwd8, seen = cast_transpose(w_kn, scale, dtype, with_amax=with_amax,
                                      implementation=casts)
    return (fwd8, inv, bwd8, inv) + ((seen,) if with_amax else ())
  if with_amax:
    raise ValueError(f"weight_copies: with_amax takes scaling 'tensor', got {scaling!r}")
  if scaling == "block":  # a 128 x 128 block is one under transposition: exact
    fwd8, fwd_inv = quantize_blocks(w_kn.T, dtype, BLOCK, margin=margin)
    return fwd8, fwd_inv, fwd8.T, fwd_inv.T
  fwd8, fwd_inv = quantize_columns_transposed(w_kn, dtype, margin=margin)
  bwd8, bwd_inv = quantize_rows(w_kn, dtype, margin=margin)
  return fwd8, fwd_inv, bwd8, bwd_inv
