"""Flax linen modules for sequence-parallel dense layers.

``ColumnParallelDense`` (fc1, QKV), ``RowParallelDense`` (fc2, out-proj) and
``SequenceParallelMLP`` (the two around an activation) work like
:class:`flax.linen.Dense` over the last dimension; the first dimension holds the
tokens, sharded over the tensor-parallel mesh axis ``axis_name`` between layers.

Each module runs in one of two modes, decided at trace time:

* **global** (the usual one): under ``jax.jit``, outside any ``shard_map`` over
  ``axis_name``. Parameters have their global shapes (a column-parallel kernel
  is ``[K, F]``) and the call goes through :mod:`jax_comm_gemm.layers.sharded`, over
  ``mesh`` or the mesh set by ``jax.set_mesh``. Initialise the parameters
  sharded by their partitioning metadata::

    abstract = jax.eval_shape(model.init, key, x)
    shardings = nn.get_sharding(abstract, mesh)
    params = jax.jit(model.init, out_shardings=shardings)(key, x)

* **local**: inside the caller's own ``jax.shard_map`` over a mesh with
  ``axis_name``. Parameters have local shapes (``[K, F/P]``): pass the shards
  that the same partition specs (``nn.get_partition_spec``) cut from the
  global parameters, and the call goes through :mod:`jax_comm_gemm.layers.local`.
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
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import (check_fields, check_split, check_token_inputs,
                                       placement)
from jax_comm_gemm.layers import local as local_layers
from jax_comm_gemm.layers import sharded
from jax_comm_gemm.validation import Names

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


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
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  config: CommGemmConfig = DEFAULT_CONFIG

  def _setup(self, inputs) -> tuple[bool, int, Names]:
    owner = type(self).__name__
    check_fields(owner, features={"features": self.features},
                 axis_name=self.axis_name, data_axes=self.data_axes, mesh=self.mesh)
    local, size = placement(owner, self.axis_name, self.mesh)
    return local, size, Names(owner, x="inputs")

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
    precision: ``lax.Precision`` of every GEMM the layer runs through XLA, the
      weight-gradient GEMMs included (cuBLASMp always accumulates in float32).
    kernel_init: initializer of the kernel (global shape ``[K, features]``).
    bias_init: initializer of the bias.
    keep_gathered_input: keep the gathered input for the weight gradient
      instead of gathering it again in the backward pass (``n*K`` memory).
    config: backend and algorithm choices.
  """

  keep_gathered_input: bool = False

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    local, size, names = self._setup(inputs)
    check_split(f"{names.op}.features", self.features, self.axis_name, size)
    out = self.features // size if local else self.features
    kernel = self._param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], out),
                         (None, self.axis_name), local)
    bias = (self._param("bias", self.bias_init, (out,), (self.axis_name,), local)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if local:
      local_layers.check_column(names, inputs, kernel, bias)
      return local_layers.column_parallel(
          inputs, kernel, bias, axis_name=self.axis_name,
          keep_gathered_input=self.keep_gathered_input, precision=self.precision,
          config=self.config)
    return sharded.column_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=tuple(self.data_axes), keep_gathered_input=self.keep_gathered_input,
        precision=self.precision, config=self.config, names=names)


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
    local, size, names = self._setup(inputs)
    in_features = jnp.shape(inputs)[-1]
    if not local:
      check_split(f"{names.op}: the input features, inputs.shape[-1]",
                  in_features, self.axis_name, size)
    kernel = self._param("kernel", self.kernel_init, (in_features, self.features),
                         (self.axis_name, None), local)
    bias = (self._param("bias", self.bias_init, (self.features,), (None,), local)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if local:
      local_layers.check_row(names, inputs, kernel, bias, self.axis_name, size)
      return local_layers.row_parallel(inputs, kernel, bias, axis_name=self.axis_name,
                                       precision=self.precision, config=self.config)
    return sharded.row_parallel_dense(
        inputs, kernel, bias, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=tuple(self.data_axes), precision=self.precision, config=self.config,
        names=names)


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
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  keep_gathered_input: bool = False
  config: CommGemmConfig = DEFAULT_CONFIG

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    check_fields(owner, features={"hidden_features": self.hidden_features},
                 axis_name=self.axis_name, data_axes=self.data_axes, mesh=self.mesh)
    local, size = placement(owner, self.axis_name, self.mesh)
    check_token_inputs(owner, inputs, local=local, axis_name=self.axis_name, size=size,
                       data_axes=tuple(self.data_axes), mesh=self.mesh)
    check_split(f"{owner}.hidden_features", self.hidden_features, self.axis_name, size)
    common = dict(axis_name=self.axis_name, mesh=self.mesh, data_axes=self.data_axes,
                  use_bias=self.use_bias, dtype=self.dtype,
                  param_dtype=self.param_dtype, precision=self.precision,
                  kernel_init=self.kernel_init, bias_init=self.bias_init,
                  config=self.config)
    h = ColumnParallelDense(self.hidden_features, name="fc1",
                            keep_gathered_input=self.keep_gathered_input,
                            **common)(inputs)
    return RowParallelDense(jnp.shape(inputs)[-1], name="fc2", **common)(
        self.activation(h))
