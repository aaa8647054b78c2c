"""The sequence-parallel Llama-class block as a Flax NNX module: the NNX
counterpart of :mod:`jax_comm_gemm.flax.llama_linen`, its parameters
``nnx.Param`` s named and sharded as
:func:`~jax_comm_gemm.layers.llama.param_layout` says (``attention_norm.scale``,
``attention.q.kernel``, ``attention.kv.kernel``, ...). Whether the key/value
heads split is decided by the mesh known at construction (given, or
``jax.set_mesh``'s); without one they are marked split, and a mesh on which
they cannot split replicates them when the block runs."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Array, Dtype, Initializer, PrecisionLike

from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.flax import common
from jax_comm_gemm.flax.common import (default_bias_init, default_kernel_init,
                                       default_scale_init)
from jax_comm_gemm.flax.llama_linen import as_matrix
from jax_comm_gemm.flax.nnx_build import arguments, init_options, known_mesh, make_param
from jax_comm_gemm.flax.nnx_fp8 import OverwriteWithGradient
from jax_comm_gemm.fp8 import AmaxHistory
from jax_comm_gemm.layers import llama
from jax_comm_gemm.layers.dense import place
from jax_comm_gemm.layers.transformer import FP8_LAYERS, ParamSpec
from jax_comm_gemm.validation import Names

class ParamGroup(nnx.Module):
  """Parameters made from a layout (a dict of ParamSpec or nested layouts),
  one attribute each; :meth:`values` returns them as the block takes them."""

  def __init__(self, layout: dict, inits: dict, param_dtype, mesh, rngs: nnx.Rngs):
    self.names = tuple(layout)
    for name, spec in layout.items():
      if isinstance(spec, ParamSpec):
        setattr(self, name, make_param(inits[name], rngs.params(), spec.shape, param_dtype,
                                       spec.names, mesh))
      else:
        setattr(self, name, ParamGroup(spec, inits, param_dtype, mesh, rngs))

  def values(self) -> dict:
    return {name: (v.values() if isinstance(v, ParamGroup) else v[...])
            for name, v in ((n, getattr(self, n)) for n in self.names)}


class Histories(nnx.Module):
  """A "delayed" FP8 recipe's amax histories, one
  :data:`~jax_comm_gemm.nnx.OverwriteWithGradient` per dense layer (rows
  AmaxHistory's, replicated; a train step replaces them with their gradients)."""

  def __init__(self, length: int, mesh):
    for name in FP8_LAYERS:
      setattr(self, name, make_param(nnx.initializers.zeros, None,
                                     (len(AmaxHistory._fields), length), jnp.float32,
                                     (None, None), mesh, kind=OverwriteWithGradient))


class SequenceParallelLlamaBlock(nnx.Module):
  """A Llama-class block, sequence- and tensor-parallel over ``axis_name``
  (the linen block's computation). Input and output ``[seq, batch, in_features]``.

  Args:
    in_features: the model width d.
    num_heads: query heads, divisible by the size of ``axis_name``.
    hidden_features: the gated MLP's hidden width F, divisible by that size.
    axis_name, mesh, dtype, param_dtype, precision, kernel_init, bias_init,
      config: as :class:`~jax_comm_gemm.nnx.ColumnParallelDense`'s.
    data_axes: mesh axes that shard the batch.
    use_bias: whether the dense layers add biases (Llama's have none).
    num_kv_heads: key/value heads, dividing num_heads (None: num_heads; 1:
      multi-query attention).
    head_dim: each head's width, even; None: the model width / num_heads.
    activation: the gate's (``jax.nn.silu``: SwiGLU, ``jax.nn.gelu``: GeGLU).
    rope_base: the rotary embeddings' base (Llama 2: 10000, Llama 3: 500000).
    causal: mask attention to earlier positions.
    epsilon: the RMSNorms' epsilon.
    scale_init: initializer of the RMSNorm scales.
    keep_gathered_input: the column-parallel layers keep their gathered input
      for the weight gradient.
    attention_implementation: ``jax.nn.dot_product_attention``'s
      ``implementation`` (None: jax chooses).
    rngs: random number generators.

  The keyword arguments are the linen block's fields, with the same defaults.

  >>> import numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> block = SequenceParallelLlamaBlock(16, 4, 32, num_kv_heads=1, mesh=mesh, rngs=nnx.Rngs(0))
  >>> block(jnp.ones((4, 1, 16))).shape
  (4, 1, 16)
  """

  def __init__(self, in_features: int, num_heads: int, hidden_features: int, *,
               axis_name: str = "tp", mesh: jax.sharding.Mesh | None = None,
               data_axes: str | Sequence[str] = (), use_bias: bool = False,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: PrecisionLike = None, kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               config: CommGemmConfig = DEFAULT_CONFIG, num_kv_heads: int | None = None,
               head_dim: int | None = None,
               activation: Callable[[Array], Array] = jax.nn.silu, rope_base: float = 10000.0,
               causal: bool = True, epsilon: float = 1e-5,
               scale_init: Initializer = default_scale_init, keep_gathered_input: bool = False,
               attention_implementation: str | None = None, rngs: nnx.Rngs):
    owner = type(self).__name__
    fields = {"in_features": in_features, "num_heads": num_heads,
              "hidden_features": hidden_features}
    o = init_options(owner, arguments(SequenceParallelLlamaBlock.__init__, locals()),
                     fields, "num_heads")
    init_options(owner, o, fields, "hidden_features")
    self.options = llama.LlamaOptions(
        num_heads=num_heads, num_kv_heads=o["num_kv_heads"], head_dim=o["head_dim"],
        activation=o["activation"], rope_base=o["rope_base"], causal=o["causal"],
        epsilon=o["epsilon"], dtype=o["dtype"], precision=o["precision"],
        keep_gathered_input=o["keep_gathered_input"],
        attention_implementation=o["attention_implementation"], config=o["config"])
    if o["head_dim"] is None and in_features % num_heads:
      raise ValueError(f"{owner}.in_features={in_features} must divide into "
                       f"num_heads={num_heads} heads of equal size (or pass head_dim)")
    known = known_mesh(o["mesh"])
    size = 1 if known is None else known.shape[o["axis_name"]]
    layout = llama.param_layout(in_features, hidden_features, self.options, o["axis_name"],
                                size, o["use_bias"])
    inits = {"kernel": as_matrix(o["kernel_init"]), "bias": o["bias_init"],
             "scale": o["scale_init"]}
    self.names = tuple(layout)
    for name, group in layout.items():
      setattr(self, name, ParamGroup(group, inits, o["param_dtype"], o["mesh"], rngs))
    # FP8 "delayed" scaling: each layer's amax history (rows AmaxHistory's), replicated.
    self.fp8_amax_history: Histories | None = nnx.data(None)
    recipe = o["config"].fp8
    if recipe is not None and recipe.scaling == "delayed":
      self.fp8_amax_history = Histories(recipe.amax_history, o["mesh"])
    for name in ("axis_name", "mesh", "data_axes"):
      setattr(self, name, o[name])

  def params(self) -> dict:
    """The parameter values as the block's functions take them.

    >>> block = SequenceParallelLlamaBlock(8, 2, 16, rngs=nnx.Rngs(0))
    >>> block.params()["mlp"]["gate_up"]["kernel"].shape
    (8, 2, 16)
    """
    return {name: getattr(self, name).values() for name in self.names}

  def fp8_histories(self) -> dict | None:
    """``{layer: AmaxHistory}`` where the recipe is "delayed", else None."""
    if self.fp8_amax_history is None:
      return None
    return {name: AmaxHistory(*getattr(self.fp8_amax_history, name)[...])
            for name in FP8_LAYERS}

  def __call__(self, inputs: Array) -> Array:
    owner = type(self).__name__
    where = place(owner, self.mesh, self.axis_name, self.data_axes)
    return common.run("llama", where, Names(owner, x="inputs"), inputs, self.params(),
                      options=self.options, fp8_histories=self.fp8_histories())
