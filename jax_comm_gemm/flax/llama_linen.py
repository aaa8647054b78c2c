"""The sequence-parallel Llama-class block as a Flax linen module:
``SequenceParallelLlamaBlock``, the block of :mod:`jax_comm_gemm.layers.llama`
(RMSNorm, grouped-query attention with rotary embeddings, a gated MLP;
activations ``[seq, batch, features]``, the sequence sharded over
``axis_name`` between blocks). Global or local mode, ``nn.remat`` and
``nn.scan`` as :class:`~jax_comm_gemm.linen.SequenceParallelTransformerBlock`;
the parameters' partitioning is :func:`~jax_comm_gemm.layers.llama.param_layout`'s."""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import initializers
from flax.typing import Array, Initializer

from jax_comm_gemm.flax import common
from jax_comm_gemm.flax.common import LinenOptions, kw_only
from jax_comm_gemm.flax.transformer_linen import _as_pairs, _Params, block_placement, fp8_histories
from jax_comm_gemm.layers import llama
from jax_comm_gemm.validation import Names


def as_matrix(init: Initializer) -> Initializer:
  """`init` for a kernel ``[K, ...]`` drawn as the matrix ``[K, prod(...)]``
  (fan-in K: a ``[d, 2, F]`` gate-and-up kernel as two ``[d, F]`` kernels are)."""
  @functools.wraps(init)
  def matrix(key, shape, dtype=jnp.float32):
    return jnp.reshape(init(key, (shape[0], int(np.prod(shape[1:]))), dtype), shape)
  return matrix


class SequenceParallelLlamaBlock(LinenOptions):
  """A Llama-class block, sequence- and tensor-parallel over ``axis_name``:
  ``h = x + out(attention(rotary(q, k), v))`` of ``RMSNorm(x)``, then
  ``h + down(activation(gate) * up)`` of ``RMSNorm(h)``. Input and output
  ``[seq, batch, d]``. No biases unless ``use_bias=True``.

  Attributes:
    num_heads: query heads, divisible by the size of ``axis_name``.
    hidden_features: the gated MLP's hidden width F, divisible by that size.
    num_kv_heads, head_dim, activation, rope_base, causal, epsilon,
      keep_gathered_input, attention_implementation: as
      :class:`~jax_comm_gemm.layers.llama.LlamaOptions`.
    scale_init: initializer of the RMSNorm scales.
    the rest: :class:`~jax_comm_gemm.flax.common.Options`, keyword-only.

  >>> import jax
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> block = SequenceParallelLlamaBlock(4, 16, num_kv_heads=2, mesh=mesh)
  >>> x = jnp.ones((4, 1, 16))
  >>> block.apply(block.init(jax.random.key(0), x), x).shape
  (4, 1, 16)
  """

  num_heads: int
  hidden_features: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  activation: Callable[[Array], Array] = nn.silu
  rope_base: float = 10000.0
  causal: bool = True
  epsilon: float = 1e-5
  use_bias: bool = kw_only(False)
  scale_init: Initializer = kw_only(initializers.ones_init())
  keep_gathered_input: bool = kw_only(False)
  attention_implementation: str | None = kw_only(None)

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    where = block_placement(self, owner, inputs)
    block_options = llama.LlamaOptions(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        activation=self.activation, rope_base=self.rope_base, causal=self.causal,
        epsilon=self.epsilon, dtype=self.dtype, precision=self.precision,
        keep_gathered_input=self.keep_gathered_input,
        attention_implementation=self.attention_implementation,
        config=common.config_of(self))
    layout = llama.param_layout(jnp.shape(inputs)[-1], self.hidden_features, block_options,
                                self.axis_name, where.size, self.use_bias)
    inits = (("kernel", as_matrix(self.kernel_init)), ("bias", self.bias_init),
             ("scale", self.scale_init))
    params = {name: _Params(_as_pairs(group), inits, self.param_dtype, where.local,
                            where.size, name=name)()
              for name, group in layout.items()}
    histories = fp8_histories(self, llama.init_fp8_histories(block_options))
    return common.run("llama", where, Names(owner, x="inputs"), inputs, params,
                      options=block_options, fp8_histories=histories)
