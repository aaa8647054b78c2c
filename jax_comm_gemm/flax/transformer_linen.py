"""The sequence-parallel transformer block as a Flax linen module.

``SequenceParallelTransformerBlock`` is a pre-LayerNorm block in Megatron's
sequence-parallel arrangement (see :mod:`jax_comm_gemm.layers.transformer`):
activations ``[seq, batch, features]``, the sequence sharded over the
tensor-parallel axis between blocks, QKV and fc1 column-parallel, the
out-projection and fc2 row-parallel, attention heads split over the axis.

Like the dense modules of :mod:`jax_comm_gemm.linen` it runs in one of two
modes, decided at trace time:

* **global**: under ``jax.jit``, outside any ``shard_map`` over ``axis_name``.
  Inputs ``[seq, batch, d]`` are sharded ``P(axis_name, data_axes, None)``
  (the batch over the data axes: data parallelism); parameters have global
  shapes. The whole block runs in one ``jax.shard_map`` over ``mesh`` (or the
  mesh of ``jax.set_mesh``).
* **local**: inside the caller's ``jax.shard_map``: inputs
  ``[seq/P, batch_local, d]``, parameters cut by ``nn.get_partition_spec``.

Parameters (``nn.Partitioned``, mesh axis names)::

  ln_1, ln_2       scale, bias              (None,)
  attention/qkv    kernel [d, 3d], bias     (None, axis_name), (axis_name,)
  attention/out    kernel [d, d],  bias     (axis_name, None), (None,)
  mlp/fc1          kernel [d, F],  bias     (None, axis_name), (axis_name,)
  mlp/fc2          kernel [F, d],  bias     (axis_name, None), (None,)

The QKV kernel's columns are ordered ``(head, {q, k, v}, head_dim)``. It works
under ``nn.remat`` and ``nn.scan`` (give ``nn.scan`` a module whose
``__call__`` takes and returns the carry, as usual).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax.common import check_fields, check_split, placement
from jax_comm_gemm.layers import transformer

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()


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


class SequenceParallelTransformerBlock(nn.Module):
  """A pre-LayerNorm transformer block, sequence- and tensor-parallel over
  ``axis_name``: ``h = x + OutProj(Attention(QKV(LN(x))))``, then
  ``h + fc2(activation(fc1(LN(h))))``. Input and output ``[seq, batch, d]``.

  Attributes:
    num_heads: attention heads in all; divisible by the size of ``axis_name``
      (each shard computes whole heads), and dividing ``d``.
    hidden_features: the MLP's hidden width, divisible by the size of ``axis_name``.
    activation: the MLP's activation.
    causal: mask attention to earlier positions (a decoder).
    epsilon: the LayerNorms' epsilon.
    axis_name: the tensor-parallel mesh axis (the sequence is sharded over it).
    mesh: the mesh in global mode; None takes the one set by ``jax.set_mesh``.
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
    attention_implementation: passed to ``jax.nn.dot_product_attention``
      (None: jax chooses; ``"xla"`` or ``"cudnn"``).
    config: backend and algorithm choices.
  """

  num_heads: int
  hidden_features: int
  activation: Callable[[Array], Array] = nn.gelu
  causal: bool = True
  epsilon: float = 1e-6
  axis_name: str = "tp"
  mesh: jax.sharding.Mesh | None = None
  data_axes: Sequence[str] = ()
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  scale_init: Initializer = initializers.ones_init()
  keep_gathered_input: bool = False
  attention_implementation: str | None = None
  config: CommGemmConfig = DEFAULT_CONFIG

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    check_fields(owner, features={"num_heads": self.num_heads,
                                  "hidden_features": self.hidden_features},
                 axis_name=self.axis_name, data_axes=self.data_axes, mesh=self.mesh)
    local, size = placement(owner, self.axis_name, self.mesh)
    check_split(f"{owner}.num_heads", self.num_heads, self.axis_name, size)
    check_split(f"{owner}.hidden_features", self.hidden_features, self.axis_name, size)
    if jnp.ndim(inputs) != 3:
      raise ValueError(f"{owner}: `inputs` must be 3-D [seq, batch, features], got "
                       f"shape {jnp.shape(inputs)}")
    layout = transformer.param_layout(jnp.shape(inputs)[-1], self.hidden_features,
                                      self.axis_name, self.use_bias)
    dense = (("kernel", self.kernel_init), ("bias", self.bias_init))
    # LayerNorm biases start at zero whatever bias_init is, as in flax.
    norm = (("scale", self.scale_init), ("bias", initializers.zeros_init()))
    params = {name: _Params(_as_pairs(group), norm if name.startswith("ln") else dense,
                            self.param_dtype, local, size, name=name)()
              for name, group in layout.items()}
    options = transformer.BlockOptions(
        num_heads=self.num_heads, activation=self.activation, causal=self.causal,
        epsilon=self.epsilon, dtype=self.dtype, precision=self.precision,
        keep_gathered_input=self.keep_gathered_input,
        attention_implementation=self.attention_implementation, config=self.config)
    if local:
      transformer.check_block(owner, "inputs", inputs, params, self.num_heads,
                              self.axis_name, size, local=True)
      return transformer.block(inputs, params, axis_name=self.axis_name, options=options)
    return transformer.sharded_transformer_block(
        inputs, params, mesh=self.mesh, axis_name=self.axis_name,
        data_axes=tuple(self.data_axes), options=options, op=owner, x_name="inputs")

