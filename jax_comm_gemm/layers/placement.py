"""Where a layer runs: the mesh, its axes, and local or global mode.

Every front-end (the functions of :mod:`~jax_comm_gemm.layers.sharded` and
:mod:`~jax_comm_gemm.layers.transformer`, the linen and NNX modules) resolves
its mesh and checks ``axis_name`` and ``data_axes`` here, so each check and
each message exists once.

``data_axes`` are the mesh axes that shard the tokens (the batch, for the
transformer block) besides ``axis_name``. A mesh axis of size > 1 that is
neither ``axis_name`` nor in ``data_axes`` (nor already manual, inside an
outer ``jax.shard_map``) is an error: the layer would silently replicate its
work over that axis, gathering whatever the caller sharded over it. To
replicate on purpose, run the layer inside a ``jax.shard_map`` over that axis.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_comm_gemm import validation


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a call runs.

  Attributes:
    local: inside the caller's ``jax.shard_map`` over ``axis_name`` (per-shard
      arrays) rather than on global arrays.
    axis_name: the tensor-parallel mesh axis.
    size: its size.
    mesh: the mesh of a global call (None locally).
    data_axes: the checked data axes, a tuple.

  >>> Placement(local=True, axis_name="tp", size=2).shards
  2
  """
  local: bool
  axis_name: str
  size: int
  mesh: object = None
  data_axes: tuple[str, ...] = ()

  @property
  def shards(self) -> int:
    """How many shards the tokens split into (globally: data x tensor axes)."""
    if self.local or self.mesh is None:
      return self.size
    return int(np.prod([self.mesh.shape[a] for a in (*self.data_axes, self.axis_name)]))


def resolve_mesh(op: str, mesh):
  """`mesh`, or the mesh set by ``jax.set_mesh``, or a clear error.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> resolve_mesh("f", mesh) is mesh
  True
  """
  if mesh is not None:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
      raise TypeError(f"{op}: `mesh` must be a jax.sharding.Mesh or None, got {mesh!r}")
    return mesh
  context = jax.sharding.get_abstract_mesh()
  if context.empty:
    raise ValueError(
        f"{op}: no mesh: pass mesh=jax.sharding.Mesh(...) or call under "
        "`with jax.set_mesh(mesh):`")
  return context


def inside_shard_map(axis_name: str) -> bool:
  """Whether we trace inside a ``jax.shard_map`` that binds `axis_name`.

  >>> inside_shard_map("tp")
  False
  """
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
  if manual is not None:
    return axis_name in manual
  try:  # a jax whose AbstractMesh lacks manual_axes
    jax.lax.axis_size(axis_name)
    return True
  except NameError:
    return False


def as_axes(op: str, axis_name, data_axes) -> tuple[str, ...]:
  """Checks the axis names' types; a str `data_axes` is one axis.

  >>> as_axes("f", "tp", "dp")
  ('dp',)
  """
  validation.check_axis_name(op, axis_name)
  if isinstance(data_axes, str):
    return (data_axes,)
  try:
    data = tuple(data_axes)
  except TypeError:
    data = None
  if data is None or not all(isinstance(a, str) for a in data):
    raise TypeError(
        f"{op}: data_axes must be a mesh axis name or a sequence of them, got {data_axes!r}")
  if axis_name in data:
    raise ValueError(f"{op}: data_axes={data} must not contain the tensor-parallel axis "
                     f"{axis_name!r}")
  if len(set(data)) != len(data):
    raise ValueError(f"{op}: data_axes={data} names an axis twice")
  return data


def check_mesh(op: str, mesh, axis_name: str, data_axes) -> tuple[int, tuple[str, ...]]:
  """(size of `axis_name`, data axes) of a global call on `mesh`, checked.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> check_mesh("f", mesh, "tp", ())
  (1, ())
  """
  data = as_axes(op, axis_name, data_axes)
  size = validation.mesh_axis_size(op, mesh, axis_name)
  names = tuple(mesh.axis_names)
  for name in data:
    if name not in names:
      raise ValueError(f"{op}: data_axes={data} names {name!r}, which is not an axis of "
                       f"the mesh, whose axes are {names}")
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  missing = tuple(a for a in names if a != axis_name and a not in data and a not in manual
                  and mesh.shape[a] > 1)
  if missing:
    raise ValueError(
        f"{op}: data_axes={data} leaves out the mesh axes {missing} (sizes "
        f"{tuple(mesh.shape[a] for a in missing)}): the layer would replicate its work "
        f"over them. Pass data_axes={data + missing} to shard over them too, or call "
        "the layer inside a jax.shard_map over them to replicate on purpose")
  return size, data


def global_placement(op: str, mesh, axis_name, data_axes) -> Placement:
  """The placement of a call on global arrays over `mesh` (or ``jax.set_mesh``'s).

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> global_placement("f", mesh, "tp", "dp")
  Traceback (most recent call last):
  ...
  ValueError: f: data_axes=('dp',) names 'dp', which is not an axis of the mesh, whose axes are ('tp',)
  """
  mesh = resolve_mesh(op, mesh)
  size, data = check_mesh(op, mesh, axis_name, data_axes)
  return Placement(False, axis_name, size, mesh, data)


def place(op: str, mesh, axis_name, data_axes) -> Placement:
  """The local-or-global decision, made at trace time, with the checks.

  Inside a ``jax.shard_map`` over `axis_name` the call is local (`mesh` and
  the data axes belong to the caller's shard_map); elsewhere it is global, on
  `mesh` or the one set by ``jax.set_mesh``.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> place("f", mesh, "tp", ()).local
  False
  """
  data = as_axes(op, axis_name, data_axes)
  if inside_shard_map(axis_name):
    return Placement(True, axis_name, int(jax.lax.axis_size(axis_name)), None, data)
  return global_placement(op, mesh, axis_name, data)
