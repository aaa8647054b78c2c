"""Flax linen modules for sequence-parallel dense layers.

``ColumnParallelDense`` (fc1, QKV), ``RowParallelDense`` (fc2, out-proj) and
``SequenceParallelMLP`` (the two around an activation) work like
:class:`flax.linen.Dense` over the last dimension; the first dimension holds the
tokens, sharded over the tensor-parallel mesh axis ``axis_name`` between layers.

Each module runs in one of two modes, decided at trace time:

* **global** (the usual one): under ``jax.jit``, outside any ``shard_map`` over
  ``axis_name``. Parameters have their global shapes (a column-parallel kernel
  is ``[K, F]``) and the call goes through :mod:`jax_comm_gemm.sharded`, over
  ``mesh`` or the mesh set by ``jax.set_mesh``. Initialise the parameters
  sharded by their partitioning metadata::

    abstract = jax.eval_shape(model.init, key, x)
    shardings = nn.get_sharding(abstract, mesh)
    params = jax.jit(model.init, out_shardings=shardings)(key, x)

* **local**: inside the caller's own ``jax.shard_map`` over a mesh with
  ``axis_name``. Parameters have local shapes (``[K, F/P]``): pass the shards
  that the same partition specs (``nn.get_partition_spec``) cut from the
  global parameters, and the call goes through :mod:`jax_comm_gemm.dense`.
  Initialise in global mode: an init inside the shard_map would give every
  shard the same random values.

Partitioning metadata (``nn.Partitioned``, mesh axis names):

=====================  ======================  ==============
module                 kernel                  bias
=====================  ======================  ==============
ColumnParallelDense    ``(None, axis_name)``   ``(axis_name,)``
RowParallelDense       ``(axis_name, None)``   ``(None,)``
=====================  ======================  ==============
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.linen.dtypes import promote_dtype
from flax.typing import Array, Dtype, Initializer

from jax_comm_gemm import dense, sharded, validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


# --- shared with jax_comm_gemm.nnx ---------------------------------------------

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
  mesh = sharded.resolve_mesh(owner, mesh)
  return False, validation.mesh_axis_size(owner, mesh, axis_name)


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


# --- modules --------------------------------------------------------------------

class _ParallelDense(nn.Module):
  """Fields and parameter handling shared by the two dense layers."""

  features: int
  axis_name: str = "tp"
  mesh: jax.sharding.Mesh | None = None
  data_axes: Sequence[str] = ()
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  config: CommGemmConfig = DEFAULT_CONFIG

  def _setup(self) -> tuple[bool, int]:
    owner = type(self).__name__
    check_fields(owner, features={"features": self.features},
                 axis_name=self.axis_name, data_axes=self.data_axes, mesh=self.mesh)
    return placement(owner, self.axis_name, self.mesh)

  def _param(self, name, init, shape, names, local):
    boxed = self.param(name, nn.with_partitioning(init, names), shape,
                       self.param_dtype, unbox=False)
    if not isinstance(boxed, nn.Partitioned):  # the caller passed unboxed params
      return boxed
    # Locally, a sharding constraint naming the manual axis would be wrong.
    return boxed.value if local else boxed.unbox()


class ColumnParallelDense(_ParallelDense):
  """``all_gather(x) @ kernel + bias`` over the last dimension (fc1, QKV).

  Input ``[n, ..., K]`` sharded along tokens over ``(*data_axes, axis_name)``;
  output ``[n, ..., features]`` sharded along features over ``axis_name`` (and
  tokens over ``data_axes``). Locally: ``[n/P, ..., K]`` to ``[n, ..., F/P]``.

  Attributes:
    features: the number of output features (global), divisible by the size
      of ``axis_name``.
    axis_name: the tensor-parallel mesh axis.
    mesh: the mesh in global mode; None takes the one set by ``jax.set_mesh``.
    data_axes: mesh axes that also shard the tokens (data parallelism).
    use_bias: whether to add a bias.
    dtype: the dtype of the computation (default: from inputs and params).
    param_dtype: the dtype passed to the initializers.
    kernel_init: initializer of the kernel (global shape ``[K, features]``).
    bias_init: initializer of the bias.
    keep_gathered_input: keep the gathered input for the weight gradient
      instead of gathering it again in the backward pass (``n*K`` memory).
    config: backend and algorithm choices.
  """

  keep_gathered_input: bool = False

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    local, size = self._setup()
    check_split(f"{type(self).__name__}.features", self.features, self.axis_name,
                size)
    out = self.features // size if local else self.features
    kernel = self._param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], out),
                         (None, self.axis_name), local)
    bias = (self._param("bias", self.bias_init, (out,), (self.axis_name,), local)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if local:
      return dense.column_parallel_dense(
          inputs, kernel, bias, axis_name=self.axis_name,
          keep_gathered_input=self.keep_gathered_input, config=self.config)
    return sharded.column_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=tuple(self.data_axes),
        keep_gathered_input=self.keep_gathered_input, config=self.config)


class RowParallelDense(_ParallelDense):
  """``reduce_scatter(h @ kernel) + bias`` over the last dimension (fc2, out-proj).

  Input ``[n, ..., F]`` sharded along features over ``axis_name`` (and tokens
  over ``data_axes``); output ``[n, ..., features]`` sharded along tokens over
  ``(*data_axes, axis_name)``. Locally: ``[n, ..., F/P]`` to ``[n/P, ..., K]``.
  The input features ``F`` must be divisible by the size of ``axis_name``.

  Attributes: as :class:`ColumnParallelDense`, without ``keep_gathered_input``;
  ``features`` (the output) is not split, and the bias is replicated.
  """

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    local, size = self._setup()
    in_features = jnp.shape(inputs)[-1]
    if not local:
      check_split(f"{type(self).__name__}: the input features, inputs.shape[-1]",
                  in_features, self.axis_name, size)
    kernel = self._param("kernel", self.kernel_init, (in_features, self.features),
                         (self.axis_name, None), local)
    bias = (self._param("bias", self.bias_init, (self.features,), (None,), local)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if local:
      return dense.row_parallel_dense(inputs, kernel, bias, axis_name=self.axis_name,
                                      config=self.config)
    return sharded.row_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=tuple(self.data_axes), config=self.config)


class SequenceParallelMLP(nn.Module):
  """``fc2(activation(fc1(x)))``: a column-parallel then a row-parallel dense.

  Input and output ``[n, ..., K]`` sharded along tokens; the hidden activations
  ``[n, ..., hidden_features]`` are sharded along features.

  Attributes:
    hidden_features: the hidden width (fc1's output), divisible by the size of
      ``axis_name``.
    activation: applied elementwise between fc1 and fc2.
    the rest: as :class:`ColumnParallelDense`, passed to both submodules
      (``keep_gathered_input`` to fc1).
  """

  hidden_features: int
  activation: Callable[[Array], Array] = nn.gelu
  axis_name: str = "tp"
  mesh: jax.sharding.Mesh | None = None
  data_axes: Sequence[str] = ()
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  keep_gathered_input: bool = False
  config: CommGemmConfig = DEFAULT_CONFIG

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    check_fields(type(self).__name__, features={"hidden_features": self.hidden_features},
                 axis_name=self.axis_name, data_axes=self.data_axes, mesh=self.mesh)
    common = dict(axis_name=self.axis_name, mesh=self.mesh, data_axes=self.data_axes,
                  use_bias=self.use_bias, dtype=self.dtype,
                  param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                  bias_init=self.bias_init, config=self.config)
    h = ColumnParallelDense(self.hidden_features, name="fc1",
                            keep_gathered_input=self.keep_gathered_input,
                            **common)(inputs)
    return RowParallelDense(jnp.shape(inputs)[-1], name="fc2", **common)(
        self.activation(h))
