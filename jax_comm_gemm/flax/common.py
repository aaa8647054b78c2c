"""What the linen and NNX modules share: the mode a call runs in, and the
checks of module fields and inputs, each naming the module and its field."""

from __future__ import annotations

import jax
import numpy as np

from jax_comm_gemm import validation
from jax_comm_gemm.layers.sharded import resolve_mesh


def inside_shard_map(axis_name: str) -> bool:
  """Whether we are tracing inside a ``jax.shard_map`` that binds `axis_name`
  (local mode), read from the abstract mesh without raising anything."""
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
  if manual is not None:
    return axis_name in manual
  try:  # a jax whose AbstractMesh lacks manual_axes
    jax.lax.axis_size(axis_name)
    return True
  except NameError:
    return False


def placement(owner: str, axis_name: str, mesh) -> tuple[bool, int]:
  """``(local, P)``: the mode and the size of the tensor-parallel axis."""
  if inside_shard_map(axis_name):
    return True, int(jax.lax.axis_size(axis_name))
  mesh = resolve_mesh(owner, mesh)
  return False, validation.mesh_axis_size(owner, mesh, axis_name)


def known_mesh(mesh):
  """`mesh`, or the one set by ``jax.set_mesh``, or None."""
  if mesh is not None:
    return mesh
  context = jax.sharding.get_abstract_mesh()
  return None if context.empty else context


def check_fields(owner: str, *, features: dict[str, int], axis_name, data_axes,
                 mesh) -> None:
  """Errors for module arguments, each naming the field."""
  for field, value in features.items():
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{owner}.{field} must be a positive int, got {value!r}")
  if not isinstance(axis_name, str):
    raise TypeError(
        f"{owner}.axis_name must be a mesh axis name (str), got {axis_name!r}")
  if isinstance(data_axes, str) or not all(isinstance(a, str) for a in data_axes):
    raise TypeError(
        f"{owner}.data_axes must be a sequence of mesh axis names, got {data_axes!r}")
  if axis_name in data_axes:
    raise ValueError(
        f"{owner}.data_axes={tuple(data_axes)} must not contain the "
        f"tensor-parallel axis {axis_name!r}")
  if mesh is not None:
    names = tuple(mesh.axis_names)
    for field, name in [("axis_name", axis_name)] + [("data_axes", a) for a in data_axes]:
      if name not in names:
        raise ValueError(
            f"{owner}.{field}: {name!r} is not an axis of the mesh, whose "
            f"axes are {names}")


def check_split(subject: str, value: int, axis_name: str, size: int) -> None:
  """`subject` (such as ``"ColumnParallelDense.features"``) must split over the axis."""
  if value % size:
    raise ValueError(
        f"{subject}={value} is not divisible by the size {size} of the "
        f"tensor-parallel mesh axis {axis_name!r}")


def check_token_inputs(owner: str, inputs, *, local: bool, axis_name: str, size: int,
                       data_axes, mesh) -> None:
  """A module whose `inputs` are sharded along tokens: at least 2-D, and the
  tokens split over every shard (globally) or gather cleanly (locally)."""
  validation.check_activations(owner, "inputs", inputs)
  if local:
    return
  mesh = resolve_mesh(owner, mesh)
  axes = (*data_axes, axis_name)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  validation.check_tokens(owner, "inputs", np.shape(inputs), "*".join(axes), shards)
