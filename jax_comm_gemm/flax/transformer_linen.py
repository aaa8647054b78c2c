"""The sequence-parallel transformer block as a Flax linen module:
``SequenceParallelTransformerBlock``, the pre-LayerNorm block of
:mod:`jax_comm_gemm.layers.transformer` (activations ``[seq, batch, features]``,
the sequence sharded over ``axis_name`` between blocks, heads split over it).

Like the dense modules it runs in global mode (under ``jax.jit``: the whole
block in one ``jax.shard_map``, the batch sharded over ``data_axes``) or in
local mode (inside the caller's ``jax.shard_map``, parameters cut by
``nn.get_partition_spec``); the parameters' partitioning is
:func:`~jax_comm_gemm.layers.transformer.param_layout`'s. It works under
``nn.remat`` and ``nn.scan``."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.typing import Array, Dtype, Initializer

from jax_comm_gemm.flax.common import (LinenOptions, check_options, check_split, kw_only,
                                       options_of)
from jax_comm_gemm.flax import common
from jax_comm_gemm.layers import transformer
from jax_comm_gemm.layers.dense import place
from jax_comm_gemm.validation import Names


class _Params(nn.Module):
  """Creates a group of parameters (a dense layer, a LayerNorm, or groups of
  them) with partitioning metadata, and returns their values as a dict.

  ``layout`` pairs each name with a ``transformer.ParamSpec`` (a parameter) or
  a nested layout (a child group of that name).
  """

  layout: tuple
  inits: tuple  # (name, initializer) pairs: for parameters named so
  param_dtype: Dtype
  local: bool
  size: int

  @nn.compact
  def __call__(self) -> dict:
    inits = dict(self.inits)
    out = {}
    for name, spec in self.layout:
      if not isinstance(spec, transformer.ParamSpec):
        out[name] = _Params(spec, self.inits, self.param_dtype, self.local, self.size,
                            name=name)()
        continue
      shape = tuple(n // self.size if a is not None and self.local else n
                    for n, a in zip(spec.shape, spec.names))
      boxed = self.param(name, nn.with_partitioning(inits[name], spec.names), shape,
                         self.param_dtype, unbox=False)
      if not isinstance(boxed, nn.Partitioned):  # the caller passed unboxed params
        out[name] = boxed
      else:  # locally, a sharding constraint naming the manual axis would be wrong
        out[name] = boxed.value if self.local else boxed.unbox()
    return out


def _as_pairs(tree) -> tuple:
  """A nested dict as nested (name, value) pairs: hashable module fields."""
  if isinstance(tree, dict):
    return tuple((k, _as_pairs(v)) for k, v in tree.items())
  return tree


def block_placement(module, owner: str, inputs):
  """Where a block `module` (linen; num_heads and hidden_features among its
  fields) runs, its options and sizes checked, each error naming its field."""
  options = options_of(module) | {
      name: getattr(module, name)
      for name in ("activation", "causal", "scale_init", "keep_gathered_input")}
  data = check_options(owner, options, features={"num_heads": module.num_heads,
                                                 "hidden_features": module.hidden_features})
  where = place(owner, module.mesh, module.axis_name, data)
  check_split(f"{owner}.num_heads", module.num_heads, module.axis_name, where.size)
  check_split(f"{owner}.hidden_features", module.hidden_features, module.axis_name, where.size)
  if jnp.ndim(inputs) != 3:
    raise ValueError(f"{owner}: `inputs` must be 3-D [seq, batch, features], got "
                     f"shape {jnp.shape(inputs)}")
  return where


def fp8_histories(module, histories):
  """A block's "delayed" FP8 amax histories as a variable of `module` in Flax's
  overwrite-with-gradient collection (None stays None)."""
  if histories is None:
    return None
  return module.variable(OVERWRITE_WITH_GRADIENT, "fp8_amax_history", lambda: histories).value


class SequenceParallelTransformerBlock(LinenOptions):
  """A pre-LayerNorm transformer block, sequence- and tensor-parallel over
  ``axis_name``: ``h = x + OutProj(Attention(QKV(LN(x))))``, then
  ``h + fc2(activation(fc1(LN(h))))``. Input and output ``[seq, batch, d]``.

  Attributes:
    num_heads, activation, causal, epsilon, keep_gathered_input,
      attention_implementation: as
      :class:`~jax_comm_gemm.layers.transformer.BlockOptions`.
    hidden_features: the MLP's hidden width, divisible by the size of ``axis_name``.
    scale_init: initializer of the LayerNorm scales (their biases start at 0).
    the rest: :class:`~jax_comm_gemm.flax.common.Options`, keyword-only;
      ``data_axes`` shard the batch.

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> block = SequenceParallelTransformerBlock(2, 16, mesh=mesh)
  >>> x = jnp.ones((4, 1, 8))
  >>> block.apply(block.init(jax.random.key(0), x), x).shape
  (4, 1, 8)
  """

  num_heads: int
  hidden_features: int
  activation: Callable[[Array], Array] = nn.gelu
  causal: bool = True
  epsilon: float = 1e-6
  scale_init: Initializer = kw_only(initializers.ones_init())
  keep_gathered_input: bool = kw_only(False)
  attention_implementation: str | None = kw_only(None)

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    where = block_placement(self, owner, inputs)
    layout = transformer.param_layout(jnp.shape(inputs)[-1], self.hidden_features,
                                      self.axis_name, self.use_bias)
    dense = (("kernel", self.kernel_init), ("bias", self.bias_init))
    # LayerNorm biases start at zero whatever bias_init is, as in flax.
    norm = (("scale", self.scale_init), ("bias", initializers.zeros_init()))
    params = {name: _Params(_as_pairs(group), norm if name.startswith("ln") else dense,
                            self.param_dtype, where.local, where.size, name=name)()
              for name, group in layout.items()}
    block_options = transformer.BlockOptions(
        num_heads=self.num_heads, activation=self.activation, causal=self.causal,
        epsilon=self.epsilon, dtype=self.dtype, precision=self.precision,
        keep_gathered_input=self.keep_gathered_input,
        attention_implementation=self.attention_implementation,
        config=common.config_of(self))
    histories = fp8_histories(self, transformer.init_fp8_histories(block_options))
    return common.run("block", where, Names(owner, x="inputs"), inputs, params,
                        options=block_options, fp8_histories=histories)
