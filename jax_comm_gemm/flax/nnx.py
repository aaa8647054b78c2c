"""Flax NNX modules for sequence-parallel dense layers: the NNX counterparts of
:mod:`jax_comm_gemm.linen`, built like :class:`flax.nnx.Linear`. Parameters are
created with their global shapes and ``out_sharding`` metadata (the linen
modules' partitioning), placed on the mesh where one is given.

Each ``__init__`` spells out its keyword-only arguments, with the names and
defaults of the linen module's fields (the shared ones are
:class:`~jax_comm_gemm.flax.common.Options`); the dense modules also take
Linear's ``dot_general``, ``promote_dtype``, ``preferred_element_type``,
``kernel_metadata`` and ``bias_metadata`` (metadata naming ``out_sharding`` is
refused); an injected ``dot_general`` or a ``preferred_element_type`` runs on
XLA's collectives (:meth:`ColumnParallelDense.path_reason`).

Global and local mode as in the linen modules; locally, split the state by
its partition specs::

  graphdef, state = nnx.split(model)
  step = lambda state, x: nnx.merge(graphdef, state)(x)
  jax.shard_map(step, mesh=mesh, in_specs=(nnx.get_partition_spec(state), P("tp")),
                out_specs=P("tp"))

With FP8 "delayed" scaling each dense layer holds its amax history,
``fp8_amax_history``, an :data:`~jax_comm_gemm.nnx.OverwriteWithGradient`
variable that the train step replaces with its gradient
(:mod:`jax_comm_gemm.flax.nnx_fp8`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm import validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import (DEFAULTS, check_token_inputs, default_bias_init,
                                       default_kernel_init, path_reason)
from jax_comm_gemm.flax.nnx_build import arguments, init_options, make_param
from jax_comm_gemm.flax.nnx_fp8 import OverwriteWithGradient
from jax_comm_gemm.fp8 import AmaxHistory
from jax_comm_gemm.flax import common
from jax_comm_gemm.layers import dense
from jax_comm_gemm.validation import Names

# Flax Linear's arguments that the dense modules take, beyond the table's
# (the linen modules take Flax Dense's instead): not compared with linen's.
LINEAR_ARGUMENTS = ("dot_general", "promote_dtype", "preferred_element_type",
                    "kernel_metadata", "bias_metadata")
NO_METADATA = MappingProxyType({})


class _ParallelDense(nnx.Module):
  """What the two dense layers share: Flax Linear's arguments, the parameters,
  and the call. ``_kind`` says which layer a subclass is; a subclass's
  ``__init__`` spells out its arguments and calls :meth:`_build`."""

  _kind = "column"

  def _build(self, in_features: int, out_features: int, rngs: nnx.Rngs, given: dict):
    owner = type(self).__name__
    column = self._kind == "column"
    o = init_options(owner, given, {"in_features": in_features,
                                    "out_features": out_features},
                     "out_features" if column else "in_features")
    for name in ("dot_general", "promote_dtype"):
      validation.check_callable(owner, name, o[name])
    for name in ("kernel_metadata", "bias_metadata"):
      if {"out_sharding", "sharding_names", "mesh"} & set(o[name]):
        raise ValueError(f"{owner}: `{name}` must not set out_sharding or mesh: the layer "
                         "shards its parameters along axis_name itself")
    axis = o["axis_name"]
    self.kernel = make_param(o["kernel_init"], rngs.params(), (in_features, out_features),
                             o["param_dtype"], (None, axis) if column else (axis, None),
                             o["mesh"], o["kernel_metadata"])
    self.bias: nnx.Param | None = nnx.data(None)
    if o["use_bias"]:
      self.bias = make_param(o["bias_init"], rngs.params(), (out_features,),
                             o["param_dtype"], (axis,) if column else (None,), o["mesh"],
                             o["bias_metadata"])
    self.in_features, self.out_features = in_features, out_features
    for name, value in o.items():
      if name not in ("kernel_init", "bias_init", "kernel_metadata", "bias_metadata"):
        setattr(self, name, value)
    # FP8 "delayed" scaling: the amax history, rows AmaxHistory's (x, w, dy),
    # replicated; a train step replaces it with its gradient (nnx_fp8.py).
    self.fp8_amax_history: OverwriteWithGradient | None = nnx.data(None)
    recipe = o["config"].fp8
    if recipe is not None and recipe.scaling == "delayed" and self.path_reason() is None:
      self.fp8_amax_history = make_param(
          nnx.initializers.zeros, None, (len(AmaxHistory._fields), recipe.amax_history),
          jnp.float32, (None, None), o["mesh"], kind=OverwriteWithGradient)

  def path_reason(self) -> str | None:
    """Why this layer runs on XLA's collectives and not on the configured
    backend (an injected dot_general, a preferred_element_type), or None
    where the backend decides.

    >>> ColumnParallelDense(3, 4, rngs=nnx.Rngs(0)).path_reason() is None
    True
    """
    injected = "dot_general" if self.dot_general is not jax.lax.dot_general else None
    return path_reason(self._kind, injected, self.preferred_element_type)

  def fp8_history(self) -> AmaxHistory | None:
    """The FP8 amax history this layer scales with (a "delayed" recipe's), or None.

    >>> from jax_comm_gemm import CommGemmConfig
    >>> from jax_comm_gemm.fp8 import Fp8Recipe
    >>> config = CommGemmConfig(fp8=Fp8Recipe("delayed", amax_history=4))
    >>> ColumnParallelDense(3, 4, config=config, rngs=nnx.Rngs(0)).fp8_history().w.tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    history = self.fp8_amax_history
    return None if history is None else AmaxHistory(*history[...])

  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    where = dense.place(owner, self.mesh, self.axis_name, self.data_axes)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    layer = dict(precision=self.precision, config=self.config)
    if self._kind == "column":
      layer["keep_gathered_input"] = self.keep_gathered_input
    if self.fp8_amax_history is not None:
      layer["fp8_history"] = self.fp8_history()
    if self.path_reason() is not None:  # Flax Linear's call of its dot_general
      kwargs = {"out_sharding": None}
      if self.preferred_element_type is not None:
        kwargs["preferred_element_type"] = self.preferred_element_type
      layer.update(dot_general=self.dot_general, dot_kwargs=tuple(kwargs.items()))
    return common.run(self._kind, where, Names(owner, x="inputs"), inputs, kernel, bias,
                        **layer)


class ColumnParallelDense(_ParallelDense):
  """``all_gather(x) @ kernel + bias`` over the last dimension (fc1, QKV), as
  :class:`jax_comm_gemm.linen.ColumnParallelDense`: input ``[n, ..., in_features]``
  sharded along tokens, output ``[n, ..., out_features]`` sharded along features.

  Args:
    in_features: the number of input features.
    out_features: the number of output features, divisible by the size of
      ``axis_name``.
    axis_name: the tensor-parallel mesh axis.
    mesh: the mesh in global mode; None takes the one set by ``jax.set_mesh``.
    data_axes: mesh axes that also shard the tokens: a name or a sequence of names.
    use_bias: whether to add a bias.
    dtype: the dtype of the computation (default: from inputs and params).
    param_dtype: the dtype passed to the initializers.
    precision: as ``lax.dot_general`` takes it, for every GEMM of the layer.
    kernel_init: initializer of the kernel (its global shape).
    bias_init: initializer of the bias.
    config: a :class:`~jax_comm_gemm.CommGemmConfig`: backend and algorithms.
    keep_gathered_input: keep the gathered input for the weight gradient
      instead of gathering it again in the backward pass (``n*K`` memory).
    dot_general, promote_dtype, preferred_element_type, kernel_metadata,
      bias_metadata: as :class:`flax.nnx.Linear` (see the module docstring).
    rngs: random number generators.

  >>> import numpy as np, jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> ColumnParallelDense(3, 4, mesh=mesh, rngs=nnx.Rngs(0))(jnp.ones((2, 3))).shape
  (2, 4)
  """

  def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: str | Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG, keep_gathered_input: bool = False,
               dot_general: Callable = jax.lax.dot_general,
               promote_dtype: Callable = dtypes.promote_dtype,
               preferred_element_type: Dtype | None = None,
               kernel_metadata: Mapping[str, Any] = NO_METADATA,
               bias_metadata: Mapping[str, Any] = NO_METADATA, rngs: nnx.Rngs):
    self._build(in_features, out_features, rngs,
                arguments(ColumnParallelDense.__init__, locals()))


class RowParallelDense(_ParallelDense):
  """``reduce_scatter(h @ kernel) + bias`` over the last dimension (fc2,
  out-proj), as :class:`jax_comm_gemm.linen.RowParallelDense`; the bias is
  replicated.

  Args:
    in_features: the number of input features, divisible by the size of
      ``axis_name``.
    out_features: the number of output features.
    axis_name, mesh, data_axes, use_bias, dtype, param_dtype, precision,
      kernel_init, bias_init, config, dot_general, promote_dtype,
      preferred_element_type, kernel_metadata, bias_metadata, rngs: as
      :class:`ColumnParallelDense`'s.

  >>> import numpy as np, jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> RowParallelDense(4, 3, mesh=mesh, rngs=nnx.Rngs(0))(jnp.ones((2, 4))).shape
  (2, 3)
  """

  _kind = "row"

  def __init__(self, in_features: int, out_features: int, *, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: str | Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG,
               dot_general: Callable = jax.lax.dot_general,
               promote_dtype: Callable = dtypes.promote_dtype,
               preferred_element_type: Dtype | None = None,
               kernel_metadata: Mapping[str, Any] = NO_METADATA,
               bias_metadata: Mapping[str, Any] = NO_METADATA, rngs: nnx.Rngs):
    self._build(in_features, out_features, rngs,
                arguments(RowParallelDense.__init__, locals()))


class SequenceParallelMLP(nnx.Module):
  """``fc2(activation(fc1(x)))``: a column-parallel then a row-parallel dense, as
  :class:`jax_comm_gemm.linen.SequenceParallelMLP`.

  Args:
    in_features: the width of the input and the output.
    hidden_features: fc1's output width, divisible by the size of ``axis_name``.
    axis_name, mesh, data_axes, use_bias, dtype, param_dtype, precision,
      kernel_init, bias_init, config: as :class:`ColumnParallelDense`'s, passed
      to both layers.
    activation: applied elementwise between fc1 and fc2.
    keep_gathered_input: passed to fc1.
    rngs: random number generators.

  >>> import numpy as np, jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> SequenceParallelMLP(3, 8, mesh=mesh, rngs=nnx.Rngs(0))(jnp.ones((2, 3))).shape
  (2, 3)
  """

  def __init__(self, in_features: int, hidden_features: int, *, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: str | Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG,
               activation: Callable[[Array], Array] = jax.nn.gelu,
               keep_gathered_input: bool = False, rngs: nnx.Rngs):
    owner = type(self).__name__
    o = init_options(owner, arguments(SequenceParallelMLP.__init__, locals()),
                     {"in_features": in_features, "hidden_features": hidden_features},
                     "hidden_features")
    common = {name: o[name] for name in DEFAULTS}
    self.fc1 = ColumnParallelDense(in_features, hidden_features, rngs=rngs,
                                   keep_gathered_input=o["keep_gathered_input"], **common)
    self.fc2 = RowParallelDense(hidden_features, in_features, rngs=rngs, **common)
    self.activation = o["activation"]

  def __call__(self, inputs: Array) -> Array:
    fc1 = self.fc1
    owner = type(self).__name__
    where = dense.place(owner, fc1.mesh, fc1.axis_name, fc1.data_axes)
    check_token_inputs(owner, inputs, where)
    return self.fc2(self.activation(fc1(inputs)))

