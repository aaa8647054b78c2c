"""The sequence-parallel transformer block as a Flax NNX module.

The NNX counterpart of :mod:`jax_comm_gemm.flax.transformer_linen`, built from
the NNX dense modules (their parameters, initialisers and ``out_sharding``
metadata): ``attention.qkv`` and ``mlp.fc1`` are
:class:`~jax_comm_gemm.nnx.ColumnParallelDense`, ``attention.out`` and
``mlp.fc2`` :class:`~jax_comm_gemm.nnx.RowParallelDense`, and the LayerNorms
hold a replicated ``scale`` and ``bias``. Activations are
``[seq, batch, features]``, the sequence sharded over ``axis_name`` between
blocks and, in global mode, the batch over ``data_axes``.

A call runs in global mode (outside any ``shard_map`` over ``axis_name``: the
whole block in one ``jax.shard_map`` over the mesh) or in local mode (inside
the caller's ``shard_map``, with the state split by
``nnx.get_partition_spec``), as the dense modules do. It works under
``nnx.remat`` and ``nnx.scan``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import placement
from jax_comm_gemm.flax.nnx import (ColumnParallelDense, RowParallelDense,
                                    SequenceParallelMLP, _check_init, _param)
from jax_comm_gemm.layers import transformer

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


class LayerNormParams(nnx.Module):
  """A LayerNorm's replicated ``scale`` and ``bias`` (``out_sharding`` ``(None,)``);
  the block applies them (``transformer.layer_norm``, flax's LayerNorm numerics)."""

  def __init__(self, num_features: int, *, param_dtype: Dtype, scale_init: Initializer,
               mesh, rngs: nnx.Rngs):
    self.scale = _param(scale_init, rngs.params(), (num_features,), param_dtype, (None,),
                        mesh)
    self.bias = _param(initializers.zeros_init(), rngs.params(), (num_features,),
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
    activation: the MLP's activation.
    causal: mask attention to earlier positions (a decoder).
    epsilon: the LayerNorms' epsilon.
    axis_name: the tensor-parallel mesh axis (the sequence is sharded over it).
    mesh: the mesh; None takes the one set by ``jax.set_mesh``.
    data_axes: mesh axes that shard the batch (data parallelism), global mode.
    use_bias: whether the dense layers have biases (the LayerNorms always do).
    dtype: the dtype of the computation (default: from inputs and params).
    param_dtype: the dtype passed to the initializers.
    precision: ``lax.Precision`` of every dense GEMM that XLA runs, the
      weight-gradient GEMMs included (cuBLASMp always accumulates in float32;
      attention's own products run at jax's default precision).
    kernel_init: initializer of the dense kernels (global shapes).
    bias_init: initializer of the dense biases.
    scale_init: initializer of the LayerNorm scales (their biases start at 0).
    keep_gathered_input: QKV and fc1 keep their gathered input for the weight
      gradient instead of gathering it again (``seq*batch*d`` memory each).
    attention_implementation: passed to ``jax.nn.dot_product_attention``.
    config: backend and algorithm choices.
    rngs: random number generators.
  """

  def __init__(self, in_features: int, num_heads: int, hidden_features: int, *,
               activation: Callable[[Array], Array] = jax.nn.gelu, causal: bool = True,
               epsilon: float = 1e-6, axis_name: str = "tp",
               mesh: jax.sharding.Mesh | None = None, data_axes: Sequence[str] = (),
               use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               scale_init: Initializer = initializers.ones_init(),
               keep_gathered_input: bool = False,
               attention_implementation: str | None = None,
               config: CommGemmConfig = DEFAULT_CONFIG, rngs: nnx.Rngs):
    owner = type(self).__name__
    fields = {"in_features": in_features, "num_heads": num_heads,
              "hidden_features": hidden_features}
    for split in ("num_heads", "hidden_features"):
      _check_init(owner, fields, split, axis_name, data_axes, mesh)
    if in_features % num_heads:
      raise ValueError(f"{owner}.in_features={in_features} must divide into "
                       f"num_heads={num_heads} heads of equal size")
    common = dict(axis_name=axis_name, mesh=mesh, data_axes=data_axes, use_bias=use_bias,
                  dtype=dtype, param_dtype=param_dtype, precision=precision,
                  kernel_init=kernel_init, bias_init=bias_init, config=config)
    norm = dict(param_dtype=param_dtype, scale_init=scale_init, mesh=mesh, rngs=rngs)
    self.ln_1 = LayerNormParams(in_features, **norm)
    self.attention = Attention(in_features, keep_gathered_input=keep_gathered_input,
                               rngs=rngs, **common)
    self.ln_2 = LayerNormParams(in_features, **norm)
    self.mlp = SequenceParallelMLP(in_features, hidden_features, activation=activation,
                                   keep_gathered_input=keep_gathered_input, rngs=rngs,
                                   **common)
    self.options = transformer.BlockOptions(
        num_heads=num_heads, activation=activation, causal=causal, epsilon=epsilon,
        dtype=dtype, precision=precision, keep_gathered_input=keep_gathered_input,
        attention_implementation=attention_implementation, config=config)
    self.axis_name = axis_name
    self.mesh = mesh
    self.data_axes = tuple(data_axes)

  def params(self) -> dict:
    """The parameter values as the block's functions take them (local shards
    in local mode)."""

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

  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    local, size = placement(owner, self.axis_name, self.mesh)
    if local:
      transformer.check_block(owner, "inputs", inputs, self.params(),
                              self.options.num_heads, self.axis_name, size, local=True)
      return transformer.block(inputs, self.params(), axis_name=self.axis_name,
                               options=self.options)
    return transformer.sharded_transformer_block(
        inputs, self.params(), mesh=self.mesh, axis_name=self.axis_name,
        data_axes=self.data_axes, options=self.options, op=owner, x_name="inputs")
