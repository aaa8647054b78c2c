"""Flax linen modules for sequence-parallel dense layers: ``ColumnParallelDense``
(fc1, QKV), ``RowParallelDense`` (fc2, out-proj) and ``SequenceParallelMLP``,
used like :class:`flax.linen.Dense` over the last dimension, the tokens first.

A call runs in one of two modes, decided at trace time
(:func:`jax_comm_gemm.layers.dense.place`):

* **global**: under ``jax.jit``, outside any ``shard_map`` over ``axis_name``;
  parameters have their global shapes, created sharded from their
  partitioning metadata::

    abstract = jax.eval_shape(model.init, key, x)
    params = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(key, x)

* **local**: inside the caller's ``jax.shard_map``; pass the parameter shards
  that ``nn.get_partition_spec`` cuts from the global ones (initialise in
  global mode: an init inside the shard_map gives every shard the same values).

Partitioning: a column-parallel kernel ``(None, axis_name)`` and bias
``(axis_name,)``; a row-parallel kernel ``(axis_name, None)`` and bias
``(None,)``. The shared options are :class:`~jax_comm_gemm.flax.common.Options`;
the dense modules also take Flax Dense's ``promote_dtype``, ``dot_general`` and
``dot_general_cls``, whose injected dot runs on XLA's collectives
(:meth:`ColumnParallelDense.path_reason`)."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from flax import linen as nn
from flax.linen.dtypes import promote_dtype
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.typing import Array

from jax_comm_gemm import validation
from jax_comm_gemm.fp8 import AmaxHistory
from jax_comm_gemm.flax.common import (LinenOptions, check_options, check_split,
                                       check_token_inputs, kw_only, options_of, path_reason)
from jax_comm_gemm.flax import common
from jax_comm_gemm.layers import dense
from jax_comm_gemm.validation import Names


class _ParallelDense(LinenOptions):
  """What the two dense layers share: Flax Dense's arguments, the parameters,
  and the call. ``_kind`` says which layer a subclass is."""

  _kind = "column"
  promote_dtype: Callable = kw_only(promote_dtype)
  dot_general: Callable | None = kw_only(None)
  dot_general_cls: Any = kw_only(None)

  def path_reason(self) -> str | None:
    """Why this layer runs on XLA's collectives and not on the configured
    backend (an injected dot product), or None where the backend decides.

    >>> ColumnParallelDense(4).path_reason() is None
    True
    """
    injected = ("dot_general_cls" if self.dot_general_cls is not None else
                "dot_general" if self.dot_general is not None else None)
    return path_reason(self._kind, injected)

  def _param(self, name, init, shape, names, local):
    boxed = self.param(name, nn.with_partitioning(init, names), shape,
                       self.param_dtype, unbox=False)
    if not isinstance(boxed, nn.Partitioned):  # the caller passed unboxed params
      return boxed
    # Locally, a sharding constraint naming the manual axis would be wrong.
    return boxed.value if local else boxed.unbox()

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    options = options_of(self) | {"keep_gathered_input": self._keep()}
    data = check_options(owner, options, features={"features": self.features})
    for name in ("promote_dtype", "dot_general", "dot_general_cls"):
      if getattr(self, name) is not None:
        validation.check_callable(owner, name, getattr(self, name))
    where = dense.place(owner, self.mesh, self.axis_name, data)
    validation.check_activations(owner, "inputs", inputs)
    in_features, axis = jnp.shape(inputs)[-1], self.axis_name
    if self._kind == "column":
      check_split(f"{owner}.features", self.features, axis, where.size)
      out = self.features // where.size if where.local else self.features
      kernel_names, bias_names = (None, axis), (axis,)
    else:
      if not where.local:
        check_split(f"{owner}: the input features, inputs.shape[-1]", in_features, axis,
                    where.size)
      out, kernel_names, bias_names = self.features, (axis, None), (None,)
    kernel = self._param("kernel", self.kernel_init, (in_features, out), kernel_names,
                         where.local)
    bias = (self._param("bias", self.bias_init, (out,), bias_names, where.local)
            if self.use_bias else None)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    dot_general = (self.dot_general_cls() if self.dot_general_cls is not None
                   else self.dot_general)
    layer = dict(precision=options["precision"], config=common.config_of(self),
                 dot_general=dot_general)
    if self._kind == "column":
      layer["keep_gathered_input"] = self.keep_gathered_input
    recipe = self.config.fp8
    if recipe is not None and recipe.scaling == "delayed" and dot_general is None:
      # Flax's overwrite-with-gradient collection (TrainState replaces it with
      # its gradient): the op's gradient with respect to it is the next history.
      layer["fp8_history"] = self.variable(OVERWRITE_WITH_GRADIENT, "fp8_amax_history",
                                           AmaxHistory.zeros, recipe).value
    return common.run(self._kind, where, Names(owner, x="inputs"), inputs, kernel, bias,
                        **layer)

  def _keep(self) -> bool:
    return getattr(self, "keep_gathered_input", False)


class ColumnParallelDense(_ParallelDense):
  """``all_gather(x) @ kernel + bias`` over the last dimension (fc1, QKV): input
  ``[n, ..., K]`` sharded along tokens over ``(*data_axes, axis_name)``, output
  ``[n, ..., features]`` sharded along features (locally ``[n/P, ..., K]`` to
  ``[n, ..., F/P]``).

  Attributes:
    features: the number of output features, divisible by the size of
      ``axis_name``.
    keep_gathered_input: keep the gathered input for the weight gradient
      instead of gathering it again in the backward pass (``n*K`` memory).
    promote_dtype, dot_general, dot_general_cls: as :class:`flax.linen.Dense`.
    the rest: :class:`~jax_comm_gemm.flax.common.Options`, keyword-only.

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> layer = ColumnParallelDense(4, mesh=mesh)
  >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> layer.apply(params, jnp.ones((2, 3))).shape
  (2, 4)
  """

  features: int
  keep_gathered_input: bool = kw_only(False)


class RowParallelDense(_ParallelDense):
  """``reduce_scatter(h @ kernel) + bias`` over the last dimension (fc2,
  out-proj): input ``[n, ..., F]`` sharded along features (F divisible by the
  size of ``axis_name``), output ``[n, ..., features]`` sharded along tokens
  (locally ``[n, ..., F/P]`` to ``[n/P, ..., K]``). Attributes: as
  :class:`ColumnParallelDense`, without ``keep_gathered_input``; the bias is
  replicated.

  >>> import jax, numpy as np
  >>> with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))):
  ...   y, _ = RowParallelDense(3).init_with_output(jax.random.key(0), jnp.ones((2, 4)))
  >>> y.shape
  (2, 3)
  """

  _kind = "row"
  features: int


class SequenceParallelMLP(LinenOptions):
  """``fc2(activation(fc1(x)))``: a column-parallel then a row-parallel dense;
  input and output ``[n, ..., K]`` sharded along tokens.

  Attributes:
    hidden_features: fc1's output width, divisible by the size of ``axis_name``.
    activation: applied elementwise between fc1 and fc2.
    keep_gathered_input: passed to fc1.
    the rest: :class:`~jax_comm_gemm.flax.common.Options`, passed to both.

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> mlp = SequenceParallelMLP(8, mesh=mesh)
  >>> mlp.apply(mlp.init(jax.random.key(0), jnp.ones((2, 3))), jnp.ones((2, 3))).shape
  (2, 3)
  """

  hidden_features: int
  activation: Callable[[Array], Array] = nn.gelu
  keep_gathered_input: bool = kw_only(False)

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    options = options_of(self)
    data = check_options(owner, options | {"activation": self.activation,
                                           "keep_gathered_input": self.keep_gathered_input},
                         features={"hidden_features": self.hidden_features})
    where = dense.place(owner, self.mesh, self.axis_name, data)
    check_token_inputs(owner, inputs, where)
    check_split(f"{owner}.hidden_features", self.hidden_features, self.axis_name,
                where.size)
    h = ColumnParallelDense(self.hidden_features, name="fc1",
                            keep_gathered_input=self.keep_gathered_input, **options)(inputs)
    return RowParallelDense(jnp.shape(inputs)[-1], name="fc2", **options)(
        self.activation(h))

