"""The fused AllGather+GEMM and GEMM+ReduceScatter of the project's extension
(cuBLASMp's algorithms and the project's own pipelined_ce): the custom calls as
JAX primitives, and :class:`CublasMpBackend`, the Backend that calls them.

A primitive rather than a bare ``jax.ffi.ffi_call``: its lowering reads the
concrete mesh of the enclosing shard_map and passes ``comm_id(mesh, axis)`` (a
pure hash), by which the handler finds the context ``connect`` made. Lowered
for another platform the ops run XLA's collectives; under ``jax.vmap``, once
per batch element."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_comm_gemm import vma
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.xla import XlaBackend, ring_matmul_reduce_scatter
from jax_comm_gemm.config import DEFAULT_ALL_GATHER_ALGORITHM, DEFAULT_REDUCE_SCATTER
from jax_comm_gemm.fp8.gemm import fp8_gemm_tn
from jax_comm_gemm.runtime import comm_id
from jax_comm_gemm.runtime.capability import VerdictKey
from jax_comm_gemm.runtime.constants import ALGORITHMS, GATHERED_LAYOUTS, TARGETS
from jax_comm_gemm.runtime.plan import Plan


def all_gather_matmul(x, w, axis_name: str, *, transpose_w: bool, return_gathered: bool,
                      algorithm: int, layout: str):
  """(y,) or (y, gathered_x); see backends.base.Backend. Checked by the caller."""
  x, w = vma.match(x, w)
  return tuple(_ag_p.bind(x, w, axis_name=axis_name, axis_size=int(lax.axis_size(axis_name)),
                          transpose_w=bool(transpose_w), return_gathered=bool(return_gathered),
                          algorithm=int(algorithm), layout=GATHERED_LAYOUTS[layout]))


def matmul_reduce_scatter(x, w, axis_name: str, *, transpose_w: bool, algorithm: int):
  x, w = vma.match(x, w)
  return _rs_p.bind(x, w, axis_name=axis_name, axis_size=int(lax.axis_size(axis_name)),
                    transpose_w=bool(transpose_w), algorithm=int(algorithm))


def fp8_all_gather_matmul(x8, w8, x_inv, w_inv, axis_name: str, *, out_dtype,
                          return_gathered: bool, algorithm: int, layout: str,
                          fast_accum: bool):
  """FP8 ``AG(x8) . w8^T * x_inv * w_inv`` in `out_dtype`: (y,) or (y, gathered
  x8); x8 [n/P, k] and w8 [m/P, k] FP8, the inverse scales f32 scalars
  (xla_ffi/context.h). Checked by the caller."""
  x8, w8, x_inv, w_inv = vma.match(x8, w8, x_inv, w_inv)
  return tuple(_fp8_ag_p.bind(
      x8, w8, x_inv, w_inv, axis_name=axis_name, axis_size=int(lax.axis_size(axis_name)),
      out_dtype=jnp.dtype(out_dtype), return_gathered=bool(return_gathered),
      algorithm=int(algorithm), layout=GATHERED_LAYOUTS[layout], fast_accum=bool(fast_accum)))


def fp8_matmul_reduce_scatter(x8, w8, x_inv, w_inv, axis_name: str, *, out_dtype,
                              algorithm: int, fast_accum: bool):
  """FP8 ``RS(x8 . w8^T) * x_inv * w_inv`` in `out_dtype`, along the tokens;
  x8 [n, k/P] and w8 [m, k/P]. Checked by the caller."""
  x8, w8, x_inv, w_inv = vma.match(x8, w8, x_inv, w_inv)
  return _fp8_rs_p.bind(x8, w8, x_inv, w_inv, axis_name=axis_name,
                        axis_size=int(lax.axis_size(axis_name)), out_dtype=jnp.dtype(out_dtype),
                        algorithm=int(algorithm), fast_accum=bool(fast_accum))


def _out_features(w, transpose_w):
  return w.shape[0] if transpose_w else w.shape[1]


def _ag_abstract_eval(x, w, *, axis_size, transpose_w, return_gathered, **_):
  # update() keeps x's sharding and varying axes (x and w agree on them).
  n = x.shape[0] * axis_size
  outs = [x.update(shape=(n, _out_features(w, transpose_w)))]
  if return_gathered:
    outs.append(x.update(shape=(n, x.shape[1])))
  return outs


def _rs_abstract_eval(x, w, *, axis_size, transpose_w, **_):
  return x.update(shape=(x.shape[0] // axis_size, _out_features(w, transpose_w)))


def _fp8_ag_abstract_eval(x8, w8, x_inv, w_inv, *, axis_size, out_dtype, return_gathered,
                          **_):
  n = x8.shape[0] * axis_size
  outs = [x8.update(shape=(n, w8.shape[0]), dtype=out_dtype)]
  if return_gathered:
    outs.append(x8.update(shape=(n, x8.shape[1])))
  return outs


def _fp8_rs_abstract_eval(x8, w8, x_inv, w_inv, *, axis_size, out_dtype, **_):
  return x8.update(shape=(x8.shape[0] // axis_size, w8.shape[0]), dtype=out_dtype)


def _comm_id(ctx, axis_name: str) -> np.int64:
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  if mesh is None or not hasattr(mesh, "devices"):
    raise ValueError(
        "jax_comm_gemm's cuBLASMp ops need the concrete mesh when they are "
        "lowered: call them inside jax.shard_map(..., mesh=jax.sharding.Mesh(...)) "
        "or under `with jax.set_mesh(mesh):`")
  return np.int64(comm_id(mesh, axis_name))


# The attributes the handlers take (xla_ffi/handlers.cc), from the primitives' params.
_ATTRIBUTES = MappingProxyType({"algorithm": np.int64, "transpose_w": bool,
                                "layout": np.int64, "fast_accum": bool})


def _lowering(target: str, **fixed):
  """The CUDA lowering of FFI target `target`: the group's comm_id, the params
  the handler takes as attributes, and `fixed` ones (the FP8 ops' w is TN)."""
  def lower(ctx, *operands, axis_name, **params):
    attributes = {k: cast(params[k]) for k, cast in _ATTRIBUTES.items() if k in params}
    return jax.ffi.ffi_lowering(TARGETS[target])(
        ctx, *operands, comm_id=_comm_id(ctx, axis_name), **attributes, **fixed)
  return lower


def _fp8_ag_elsewhere(x8, w8, x_inv, w_inv, *, axis_name, out_dtype, return_gathered,
                      fast_accum, **_):
  g8 = lax.all_gather(x8, axis_name, axis=0, tiled=True)
  y = fp8_gemm_tn(g8, w8, x_inv, w_inv, out_dtype, form="direct", fast_accum=fast_accum)
  return [y, g8] if return_gathered else [y]


def _fp8_rs_elsewhere(x8, w8, x_inv, w_inv, *, axis_name, out_dtype, fast_accum, **_):
  y = fp8_gemm_tn(x8, w8, x_inv, w_inv, out_dtype, form="direct", fast_accum=fast_accum)
  return lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)


def _ag_elsewhere(x, w, *, axis_name, transpose_w, return_gathered, **_):
  out = XlaBackend().all_gather_matmul(x, w, axis_name, transpose_w=transpose_w,
                                       return_gathered=return_gathered)
  return list(out) if return_gathered else [out]


def _rs_elsewhere(x, w, *, axis_name, transpose_w, **_):
  return XlaBackend().matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w)


def _per_element(primitive):
  """A batching rule that runs the op once per batch element: the fused ops
  gather along tokens, so a batch dimension cannot fold into them."""

  def rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    outs = []
    for i in range(size):
      element = [a if d is None else a[i] for a, d in zip(moved, dims)]
      out = primitive.bind(*element, **params)
      outs.append(out if primitive.multiple_results else [out])
    stacked = [jnp.stack(column) for column in zip(*outs)]
    if primitive.multiple_results:
      return stacked, [0] * len(stacked)
    return stacked[0], 0

  return rule


def _eager(*args, **kwargs):
  raise ValueError("jax_comm_gemm's cuBLASMp ops run inside jax.shard_map only")


def _primitive(target: str, abstract_eval, elsewhere, multiple_results: bool, **fixed):
  """The primitive of FFI target `target` (its name too): the custom call on CUDA,
  `elsewhere` (XLA's collectives) on other platforms, once per batch element
  under vmap, an error outside shard_map."""
  p = Primitive(TARGETS[target])
  p.multiple_results = multiple_results
  p.def_abstract_eval(abstract_eval)
  p.def_impl(_eager)
  mlir.register_lowering(p, _lowering(target, **fixed), platform="cuda")
  mlir.register_lowering(p, mlir.lower_fun(elsewhere, multiple_results=multiple_results))
  batching.primitive_batchers[p] = _per_element(p)
  return p


_ag_p = _primitive("all_gather_matmul", _ag_abstract_eval, _ag_elsewhere, True)
_rs_p = _primitive("matmul_reduce_scatter", _rs_abstract_eval, _rs_elsewhere, False)
_fp8_ag_p = _primitive("fp8_all_gather_matmul", _fp8_ag_abstract_eval, _fp8_ag_elsewhere, True,
                       transpose_w=True)
_fp8_rs_p = _primitive("fp8_matmul_reduce_scatter", _fp8_rs_abstract_eval, _fp8_rs_elsewhere,
                       False, transpose_w=True)


@dataclasses.dataclass(frozen=True)
class CublasMpBackend(Backend):
  """The fused ops on the communicators that ``connect`` set up. Its fields are
  the fused ops' options with the project's defaults, ``CommGemmConfig``'s:
  ``all_gather_algorithm`` and ``reduce_scatter`` (config.py);
  and `plan`, whose self-test verdicts and gathered layout the ops bind with.
  ``routes.bound`` sets it where a route is decided (the layer's or op's
  entry, ``resolve_backend``), so a backward traced later binds as its
  forward's route said; the ops never read the plan in force, and one called
  with no plan bound is an error that says how to bind one.

  >>> CublasMpBackend().all_gather_algorithm
  'split_p2p'
  """

  all_gather_algorithm: str = DEFAULT_ALL_GATHER_ALGORITHM
  reduce_scatter: str = DEFAULT_REDUCE_SCATTER
  plan: Plan | None = dataclasses.field(default=None, repr=False)

  name = "cublasmp"
  fp8_fused_ops = True

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    # cuBLASMp computes in float32 (CUBLAS_COMPUTE_32F): `precision` is moot.
    if lax.axis_size(axis_name) == 1:  # nothing to communicate
      return XlaBackend().all_gather_matmul(x, w, axis_name, transpose_w=transpose_w,
                                            return_gathered=return_gathered,
                                            precision=precision)
    if return_gathered:
      verdict = self.gathered_reuse(lax.axis_size(axis_name), x.dtype, transpose_w)
      if not verdict.ok:  # a caller that skipped routes.gathered_route
        raise RuntimeError(f"the gathered operand was asked for without a passing "
                           f"verdict: {verdict.reason}")
    outs = all_gather_matmul(
        x, w, axis_name, transpose_w=transpose_w, return_gathered=return_gathered,
        algorithm=ALGORITHMS[self.all_gather_algorithm], layout=self._plan().layout)
    return tuple(outs) if return_gathered else outs[0]

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    if self.reduce_scatter == "xla" or lax.axis_size(axis_name) == 1:
      return XlaBackend().matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w,
                                                precision=precision)
    if self.reduce_scatter == "ring":
      return ring_matmul_reduce_scatter(x, w, axis_name, transpose_w, precision)
    return matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w,
                                            algorithm=ALGORITHMS[self.reduce_scatter])

  # --- FP8 (jax_comm_gemm/fp8/steps.py calls these for `collectives=self`) ----
  # One scale per tensor; w in the TN form [features, k]; the scales are the
  # inverse (dequantizing) ones, f32 scalars (xla_ffi/context.h).

  def fp8_all_gather_matmul(self, x8, w8, x_inv, w_inv, axis_name, *, out_dtype,
                            fast_accum, return_gathered):
    """``(y, g8)``: y = ``AG(x8) . w8^T`` scaled, and the gathered x8 where
    `return_gathered` asks for it and the self-test's verdict lets the op hand
    it out (else None: the caller gathers again)."""
    reuse = return_gathered and self.gathered_reuse(lax.axis_size(axis_name), x8.dtype,
                                                    True).ok
    outs = fp8_all_gather_matmul(
        x8, w8, x_inv, w_inv, axis_name, out_dtype=out_dtype, return_gathered=reuse,
        algorithm=ALGORITHMS[self.all_gather_algorithm], layout=self._plan().layout,
        fast_accum=fast_accum)
    return outs[0], (outs[1] if reuse else None)

  def fp8_matmul_reduce_scatter(self, x8, w8, x_inv, w_inv, axis_name, *, out_dtype,
                                fast_accum):
    """``RS(x8 . w8^T)`` scaled, on the algorithm `reduce_scatter` names (the
    caller runs "xla" and "ring" itself, in FP8)."""
    return fp8_matmul_reduce_scatter(
        x8, w8, x_inv, w_inv, axis_name, out_dtype=out_dtype,
        algorithm=ALGORITHMS[self.reduce_scatter], fast_accum=fast_accum)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    plan = self._plan()
    return plan.verdict(VerdictKey(int(axis_size), self.all_gather_algorithm,
                                   jnp.dtype(dtype).name, bool(transpose_w), plan.layout))

  def _plan(self) -> Plan:
    """The plan the ops bind with: the one bound where the route was decided."""
    if self.plan is None:
      raise RuntimeError(unbound(self))
    return self.plan


def unbound(backend) -> str:
  """Why `backend`'s ops cannot run: no routing plan is bound to it, and how to bind one."""
  return (f"{type(backend).__name__} has no routing plan bound (its ops bind with the "
          "plan's gathered layout and self-test verdicts, and never read the plan in "
          "force): pass it as CommGemmConfig(backend=...) to a layer or op, which binds "
          "the plan in force at its entry, or bind one yourself: "
          "jax_comm_gemm.backends.resolve_backend(CommGemmConfig(backend=backend), axis_name, mesh), "
          "or jax_comm_gemm.backends.routes.bound(backend, jax_comm_gemm.runtime.REGISTRY.plan())")
