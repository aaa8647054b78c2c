"""Varying-manual-axes helpers that work across jax versions.

Inside ``shard_map(check_vma=True)`` every value records the mesh axes along
which it varies. A custom primitive must give its outputs the right set, and
its inputs must agree on it (as ``jax.ffi.ffi_call`` also requires).
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def shaped_like(x, shape, dtype):
  """A ``jax.ShapeDtypeStruct`` of `shape` and `dtype` that varies where `x`
  does: a kernel's output (``pl.pallas_call``'s `out_shape` inside a
  ``shard_map(check_vma=True)``), computed from `x` alone."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def pvary(x, axes):
  """Marks `x` as varying along `axes` too (a no-op for axes it varies on)."""
  missing = tuple(sorted(set(axes) - varying_axes(x)))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)


def varying_along(axis_name, *xs):
  """The custom_vjps' inputs (bf16 and FP8), each varying along `axis_name` and
  every axis any of them varies on. The gradients vary there, and a cotangent
  must have its primal's type; a weight replicated along the data axes (or an
  input replicated along `axis_name`) thus gets its gradient summed by pvary's
  transpose, outside the custom_vjp. A no-op under shard_map(check_vma=False)."""
  axes = frozenset({axis_name}).union(*(varying_axes(x) for x in xs))
  return tuple(pvary(x, axes) for x in xs)


def match(*xs):
  """The inputs, each varying along the union of the axes any of them varies on."""
  union = frozenset().union(*(varying_axes(x) for x in xs))
  return tuple(pvary(x, union) for x in xs)
