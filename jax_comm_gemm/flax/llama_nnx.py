"""The sequence-parallel Llama-class block as a Flax NNX module: the NNX
counterpart of :mod:`jax_comm_gemm.flax.llama_linen`, its parameters
``nnx.Param`` s named and sharded as
:func:`~jax_comm_gemm.layers.llama.param_layout` says (``attention_norm.scale``,
``attention.q.kernel``, ``attention.kv.kernel``, ...). Whether the key/value
heads split is decided by the mesh known at construction (given, or
``jax.set_mesh``'s); without one they are marked split, and a mesh on which
they cannot split replicates them when the block runs."""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Array

from jax_comm_gemm.flax import common
from jax_comm_gemm.flax.llama_linen import as_matrix
from jax_comm_gemm.flax.nnx import _known_mesh, init_options, make_param
from jax_comm_gemm.flax.nnx_fp8 import OverwriteWithGradient
from jax_comm_gemm.fp8 import AmaxHistory
from jax_comm_gemm.layers import llama
from jax_comm_gemm.layers.dense import place
from jax_comm_gemm.layers.transformer import FP8_LAYERS, ParamSpec
from jax_comm_gemm.validation import Names

# The block's own arguments (beyond the shared Options), with their defaults.
LLAMA_DEFAULTS = MappingProxyType(dict(
    num_kv_heads=None, head_dim=None, activation=jax.nn.silu, rope_base=10000.0, causal=True,
    epsilon=1e-5, scale_init=initializers.ones_init(), keep_gathered_input=False,
    attention_implementation=None))


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
    num_heads, hidden_features: as the linen block's.
    rngs: random number generators.
    the rest (keyword-only): the linen block's attributes (``use_bias``
      defaults to False).

  >>> import numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> block = SequenceParallelLlamaBlock(16, 4, 32, num_kv_heads=1, mesh=mesh, rngs=nnx.Rngs(0))
  >>> block(jnp.ones((4, 1, 16))).shape
  (4, 1, 16)
  """

  def __init__(self, in_features: int, num_heads: int, hidden_features: int, *,
               rngs: nnx.Rngs, **given):
    owner = type(self).__name__
    given = {"use_bias": False} | given
    fields = {"in_features": in_features, "num_heads": num_heads,
              "hidden_features": hidden_features}
    o = init_options(owner, given, LLAMA_DEFAULTS, fields, "num_heads")
    init_options(owner, o, LLAMA_DEFAULTS, fields, "hidden_features")
    self.options = llama.LlamaOptions(
        num_heads=num_heads, num_kv_heads=o["num_kv_heads"], head_dim=o["head_dim"],
        activation=o["activation"], rope_base=o["rope_base"], causal=o["causal"],
        epsilon=o["epsilon"], dtype=o["dtype"], precision=o["precision"],
        keep_gathered_input=o["keep_gathered_input"],
        attention_implementation=o["attention_implementation"], config=o["config"])
    if o["head_dim"] is None and in_features % num_heads:
      raise ValueError(f"{owner}.in_features={in_features} must divide into "
                       f"num_heads={num_heads} heads of equal size (or pass head_dim)")
    known = _known_mesh(o["mesh"])
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
