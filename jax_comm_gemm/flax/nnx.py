"""Flax NNX modules for sequence-parallel dense layers.

The NNX counterparts of :mod:`jax_comm_gemm.linen`: ``ColumnParallelDense``,
``RowParallelDense`` and ``SequenceParallelMLP``, built like
:class:`flax.nnx.Linear`. Parameters are created with their global shapes and
``out_sharding`` metadata naming the tensor-parallel mesh axis (see
:func:`flax.nnx.get_partition_spec`):

=====================  ======================  ==============
module                 kernel                  bias
=====================  ======================  ==============
ColumnParallelDense    ``(None, axis_name)``   ``(axis_name,)``
RowParallelDense       ``(axis_name, None)``   ``(None,)``
=====================  ======================  ==============

With a mesh (``mesh=`` or ``jax.set_mesh``) the parameters are placed on it
when they are created (flax's eager sharding); without one they are left
unplaced, with the metadata, for the caller to place.

A call runs in one of two modes, decided at trace time:

* **global**: outside any ``shard_map`` over ``axis_name`` (typically under
  ``jax.jit``); goes through :mod:`jax_comm_gemm.layers.sharded`.
* **local**: inside the caller's ``jax.shard_map`` over ``axis_name``, with the
  module's state split into local shards by its partition specs::

    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)

    def step(state, x):
      return nnx.merge(graphdef, state)(x)

    jax.shard_map(step, mesh=mesh, in_specs=(specs, P("tp")), out_specs=P("tp"))

  and goes through :mod:`jax_comm_gemm.layers.local` on the local parameter values.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm import validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import (check_fields, check_split, check_token_inputs,
                                       known_mesh, placement)
from jax_comm_gemm.layers import local as local_layers
from jax_comm_gemm.layers import sharded
from jax_comm_gemm.validation import Names

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


def _check_init(owner: str, features: dict[str, int], split_field: str,
                axis_name, data_axes, mesh) -> None:
  """Checks the arguments; the split one against the axis size if a mesh is known."""
  check_fields(owner, features=features, axis_name=axis_name, data_axes=data_axes,
               mesh=mesh)
  if (known := known_mesh(mesh)) is not None:
    size = validation.mesh_axis_size(owner, known, axis_name)
    check_split(f"{owner}.{split_field}", features[split_field], axis_name, size)


def _param(init, key, shape, dtype, names, mesh) -> nnx.Param:
  metadata = {"out_sharding": names}
  if mesh is not None:
    metadata["mesh"] = mesh
  # Flax shards a variable with out_sharding metadata when it is created, and
  # that needs a mesh; without one, keep the metadata and place it later.
  quiet = (contextlib.nullcontext() if known_mesh(mesh) is not None
           else nnx.use_eager_sharding(False))
  with quiet:
    return nnx.Param(init(key, shape, dtype), **metadata)


class _ParallelDense(nnx.Module):
  """Parameters and checks shared by the two dense layers."""

  def __init__(self, in_features: int, out_features: int, *, split: int,
               axis_name: str, mesh, data_axes: Sequence[str], use_bias: bool,
               dtype: Dtype | None, param_dtype: Dtype, precision: PrecisionLike,
               kernel_init: Initializer, bias_init: Initializer, config: CommGemmConfig,
               rngs: nnx.Rngs):
    _check_init(type(self).__name__, {"in_features": in_features,
                                      "out_features": out_features},
                ("in_features", "out_features")[split], axis_name, data_axes, mesh)
    kernel_names = (None, axis_name) if split == 1 else (axis_name, None)
    self.kernel = _param(kernel_init, rngs.params(), (in_features, out_features),
                         param_dtype, kernel_names, mesh)
    self.bias: nnx.Param | None
    if use_bias:
      bias_names = (axis_name,) if split == 1 else (None,)
      self.bias = _param(bias_init, rngs.params(), (out_features,), param_dtype,
                         bias_names, mesh)
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.axis_name = axis_name
    self.mesh = mesh
    self.data_axes = tuple(data_axes)
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.config = config

  def _operands(self, inputs):
    """(local, size, names, inputs, kernel, bias), promoted to the computation dtype."""
    owner = type(self).__name__
    local, size = placement(owner, self.axis_name, self.mesh)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = dtypes.promote_dtype((inputs, kernel, bias),
                                                dtype=self.dtype)
    return local, size, Names(owner, x="inputs"), inputs, kernel, bias


class ColumnParallelDense(_ParallelDense):
  """``all_gather(x) @ kernel + bias`` over the last dimension (fc1, QKV).

  Input ``[n, ..., in_features]`` sharded along tokens over
  ``(*data_axes, axis_name)``; output ``[n, ..., out_features]`` sharded along
  features over ``axis_name``. Locally: ``[n/P, ..., K]`` to ``[n, ..., F/P]``.

  Args:
    in_features: the number of input features.
    out_features: the number of output features, divisible by the size of
      ``axis_name``.
    axis_name: the tensor-parallel mesh axis.
    mesh: the mesh; None takes the one set by ``jax.set_mesh``.
    data_axes: mesh axes that also shard the tokens (data parallelism).
    use_bias: whether to add a bias.
    dtype: the dtype of the computation (default: from inputs and params).
    param_dtype: the dtype passed to the initializers.
    precision: ``lax.Precision`` of every GEMM the layer runs through XLA, the
      weight-gradient GEMMs included (cuBLASMp always accumulates in float32).
    kernel_init: initializer of the kernel, ``[in_features, out_features]``.
    bias_init: initializer of the bias.
    keep_gathered_input: keep the gathered input for the weight gradient
      instead of gathering it again in the backward pass (``n*K`` memory).
    config: backend and algorithm choices.
    rngs: random number generators.
  """

  def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               keep_gathered_input: bool = False,
               config: CommGemmConfig = DEFAULT_CONFIG, rngs: nnx.Rngs):
    super().__init__(in_features, out_features, split=1, axis_name=axis_name,
                     mesh=mesh, data_axes=data_axes, use_bias=use_bias, dtype=dtype,
                     param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                     bias_init=bias_init, config=config, rngs=rngs)
    self.keep_gathered_input = keep_gathered_input

  def __call__(self, inputs: Array) -> Array:
    local, _, names, inputs, kernel, bias = self._operands(inputs)
    if local:
      local_layers.check_column(names, inputs, kernel, bias)
      return local_layers.column_parallel(
          inputs, kernel, bias, axis_name=self.axis_name,
          keep_gathered_input=self.keep_gathered_input, precision=self.precision,
          config=self.config)
    return sharded.column_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=self.data_axes, keep_gathered_input=self.keep_gathered_input,
        precision=self.precision, config=self.config, names=names)


class RowParallelDense(_ParallelDense):
  """``reduce_scatter(h @ kernel) + bias`` over the last dimension (fc2, out-proj).

  Input ``[n, ..., in_features]`` sharded along features over ``axis_name``;
  output ``[n, ..., out_features]`` sharded along tokens over
  ``(*data_axes, axis_name)``. Locally: ``[n, ..., F/P]`` to ``[n/P, ..., K]``.

  Args: as :class:`ColumnParallelDense`, without ``keep_gathered_input``;
  ``in_features`` must be divisible by the size of ``axis_name``, and the bias
  (``[out_features]``) is replicated.
  """

  def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG, rngs: nnx.Rngs):
    super().__init__(in_features, out_features, split=0, axis_name=axis_name,
                     mesh=mesh, data_axes=data_axes, use_bias=use_bias, dtype=dtype,
                     param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                     bias_init=bias_init, config=config, rngs=rngs)

  def __call__(self, inputs: Array) -> Array:
    local, size, names, inputs, kernel, bias = self._operands(inputs)
    if local:
      local_layers.check_row(names, inputs, kernel, bias, self.axis_name, size)
      return local_layers.row_parallel(inputs, kernel, bias, axis_name=self.axis_name,
                                       precision=self.precision, config=self.config)
    return sharded.row_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=self.data_axes, precision=self.precision, config=self.config,
        names=names)


class SequenceParallelMLP(nnx.Module):
  """``fc2(activation(fc1(x)))``: a column-parallel then a row-parallel dense.

  Input and output ``[n, ..., in_features]`` sharded along tokens; the hidden
  activations ``[n, ..., hidden_features]`` are sharded along features.

  Args:
    in_features: the width of the input and the output.
    hidden_features: fc1's output width, divisible by the size of ``axis_name``.
    activation: applied elementwise between fc1 and fc2.
    the rest: as :class:`ColumnParallelDense`, passed to both submodules
      (``keep_gathered_input`` to fc1).
  """

  def __init__(self, in_features: int, hidden_features: int, *,
               activation: Callable[[Array], Array] = jax.nn.gelu,
               axis_name: str = "tp", mesh: jax.sharding.Mesh | None = None,
               data_axes: Sequence[str] = (), use_bias: bool = True,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               keep_gathered_input: bool = False,
               config: CommGemmConfig = DEFAULT_CONFIG, rngs: nnx.Rngs):
    _check_init(type(self).__name__, {"in_features": in_features,
                                      "hidden_features": hidden_features},
                "hidden_features", axis_name, data_axes, mesh)
    common = dict(axis_name=axis_name, mesh=mesh, data_axes=data_axes,
                  use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  precision=precision, kernel_init=kernel_init, bias_init=bias_init,
                  config=config, rngs=rngs)
    self.fc1 = ColumnParallelDense(in_features, hidden_features,
                                   keep_gathered_input=keep_gathered_input, **common)
    self.fc2 = RowParallelDense(hidden_features, in_features, **common)
    self.activation = activation

  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    fc1 = self.fc1
    local, size = placement(owner, fc1.axis_name, fc1.mesh)
    check_token_inputs(owner, inputs, local=local, axis_name=fc1.axis_name, size=size,
                       data_axes=fc1.data_axes, mesh=fc1.mesh)
    return self.fc2(self.activation(fc1(inputs)))
