"""The sequence-parallel transformer block as a Flax NNX module: the NNX
counterpart of :mod:`jax_comm_gemm.flax.transformer_linen`, built from the NNX
dense modules (``attention.qkv``, ``attention.out``, ``mlp.fc1``, ``mlp.fc2``)
and two LayerNorms of replicated ``scale`` and ``bias``. It runs in global or
local mode as the dense modules do, and under ``nnx.remat`` and ``nnx.scan``."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import (DEFAULTS, default_bias_init, default_kernel_init,
                                       default_scale_init)
from jax_comm_gemm.flax.nnx import ColumnParallelDense, RowParallelDense, SequenceParallelMLP
from jax_comm_gemm.flax.nnx_build import arguments, init_options, make_param
from jax_comm_gemm.flax import common
from jax_comm_gemm.layers import transformer
from jax_comm_gemm.layers.dense import place
from jax_comm_gemm.validation import Names

class LayerNormParams(nnx.Module):
  """A LayerNorm's replicated ``scale`` and ``bias``; the block applies them
  (``transformer.layer_norm``, flax's LayerNorm numerics)."""

  def __init__(self, num_features: int, *, param_dtype: Dtype, scale_init: Initializer,
               mesh, rngs: nnx.Rngs):
    self.scale = make_param(scale_init, rngs.params(), (num_features,), param_dtype,
                            (None,), mesh)
    self.bias = make_param(initializers.zeros_init(), rngs.params(), (num_features,),
                           param_dtype, (None,), mesh)


class Attention(nnx.Module):
  """The block's attention parameters: ``qkv`` (column-parallel, columns
  ``(head, {q, k, v}, head_dim)``) and ``out`` (row-parallel)."""

  def __init__(self, features: int, *, rngs: nnx.Rngs, keep_gathered_input: bool,
               **common):
    self.qkv = ColumnParallelDense(features, 3 * features,
                                   keep_gathered_input=keep_gathered_input, rngs=rngs,
                                   **common)
    self.out = RowParallelDense(features, features, rngs=rngs, **common)


class SequenceParallelTransformerBlock(nnx.Module):
  """A pre-LayerNorm transformer block, sequence- and tensor-parallel over
  ``axis_name``: ``h = x + OutProj(Attention(QKV(LN(x))))``, then
  ``h + fc2(activation(fc1(LN(h))))``. Input and output ``[seq, batch, in_features]``.

  Args:
    in_features: the model width d, divisible by ``num_heads``.
    num_heads: attention heads in all, divisible by the size of ``axis_name``.
    hidden_features: the MLP's hidden width, divisible by the size of ``axis_name``.
    axis_name, mesh, use_bias, dtype, param_dtype, precision, kernel_init,
      bias_init, config: as :class:`~jax_comm_gemm.nnx.ColumnParallelDense`'s.
    data_axes: mesh axes that shard the batch.
    activation: the MLP's activation.
    causal: mask attention to earlier positions.
    epsilon: the LayerNorms' epsilon (as ``flax.nnx.LayerNorm``).
    scale_init: initializer of the LayerNorm scales (their biases start at 0).
    keep_gathered_input: QKV and fc1 keep their gathered input for the weight
      gradient (``seq*b*d`` memory each).
    attention_implementation: ``jax.nn.dot_product_attention``'s
      ``implementation`` (None: jax chooses).
    rngs: random number generators.

  The keyword arguments are the linen block's fields, with the same defaults.

  >>> import numpy as np, jax.numpy as jnp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> block = SequenceParallelTransformerBlock(8, 2, 16, mesh=mesh, rngs=nnx.Rngs(0))
  >>> block(jnp.ones((4, 1, 8))).shape
  (4, 1, 8)
  """

  def __init__(self, in_features: int, num_heads: int, hidden_features: int, *,
               axis_name: str = "tp", mesh: jax.sharding.Mesh | None = None,
               data_axes: str | Sequence[str] = (), use_bias: bool = True,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None, kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG,
               activation: Callable[[Array], Array] = jax.nn.gelu, causal: bool = True,
               epsilon: float = 1e-6, scale_init: Initializer = default_scale_init,
               keep_gathered_input: bool = False, attention_implementation: str | None = None,
               rngs: nnx.Rngs):
    owner = type(self).__name__
    fields = {"in_features": in_features, "num_heads": num_heads,
              "hidden_features": hidden_features}
    o = init_options(owner, arguments(SequenceParallelTransformerBlock.__init__, locals()),
                     fields, "num_heads")
    init_options(owner, o, fields, "hidden_features")
    if in_features % num_heads:
      raise ValueError(f"{owner}.in_features={in_features} must divide into "
                       f"num_heads={num_heads} heads of equal size")
    common = {name: o[name] for name in DEFAULTS}
    norm = dict(param_dtype=o["param_dtype"], scale_init=o["scale_init"], mesh=o["mesh"],
                rngs=rngs)
    keep = o["keep_gathered_input"]
    self.ln_1 = LayerNormParams(in_features, **norm)
    self.attention = Attention(in_features, keep_gathered_input=keep, rngs=rngs, **common)
    self.ln_2 = LayerNormParams(in_features, **norm)
    self.mlp = SequenceParallelMLP(in_features, hidden_features, activation=o["activation"],
                                   keep_gathered_input=keep, rngs=rngs, **common)
    self.options = transformer.BlockOptions(
        num_heads=num_heads, activation=o["activation"], causal=o["causal"],
        epsilon=o["epsilon"], dtype=o["dtype"], precision=o["precision"],
        keep_gathered_input=keep, attention_implementation=o["attention_implementation"],
        config=o["config"])
    self.axis_name = o["axis_name"]
    self.mesh = o["mesh"]
    self.data_axes = o["data_axes"]

  def params(self) -> dict:
    """The parameter values as the block's functions take them (local shards
    in local mode).

    >>> block = SequenceParallelTransformerBlock(8, 2, 16, rngs=nnx.Rngs(0))
    >>> block.params()["mlp"]["fc1"]["kernel"].shape
    (8, 16)
    """

    def dense(m):
      return {"kernel": m.kernel[...]} | ({"bias": m.bias[...]} if m.bias is not None
                                          else {})

    def norm(m):
      return {"scale": m.scale[...], "bias": m.bias[...]}

    return {"ln_1": norm(self.ln_1),
            "attention": {"qkv": dense(self.attention.qkv),
                          "out": dense(self.attention.out)},
            "ln_2": norm(self.ln_2),
            "mlp": {"fc1": dense(self.mlp.fc1), "fc2": dense(self.mlp.fc2)}}

  def fp8_histories(self) -> dict | None:
    """The dense layers' FP8 amax histories as the block's functions take them
    (``{layer: AmaxHistory}``, :func:`~jax_comm_gemm.layers.transformer.init_fp8_histories`'
    names) where the recipe is "delayed", else None.

    >>> SequenceParallelTransformerBlock(8, 2, 16, rngs=nnx.Rngs(0)).fp8_histories() is None
    True
    """
    layers = {"qkv": self.attention.qkv, "out": self.attention.out, "fc1": self.mlp.fc1,
              "fc2": self.mlp.fc2}
    histories = {name: layer.fp8_history() for name, layer in layers.items()}
    return None if any(h is None for h in histories.values()) else histories

  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    where = place(owner, self.mesh, self.axis_name, self.data_axes)
    return common.run("block", where, Names(owner, x="inputs"), inputs, self.params(),
                        options=self.options, fp8_histories=self.fp8_histories())
