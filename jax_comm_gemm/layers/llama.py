"""A sequence-parallel Llama-class block (Megatron's arrangement): RMSNorm,
grouped-query attention with rotary embeddings, a gated MLP (SwiGLU or
GeGLU), biases optional. The local core, inside ``jax.shard_map``, and its
global-array wrapper; activations ``[seq, batch, d]`` with the sequence sharded
over the tensor-parallel axis between blocks. Longer than 300 lines: one
model's options, layout, block and checks, each public function with a
runnable example::

  x -> RMSNorm -> q, k, v (ONE column-parallel op) -> rotary(q, k) -> attention
    -> out (row-parallel) -> + x = h
  h -> RMSNorm -> gate, up (ONE column-parallel op) -> act(gate) * up
    -> down (row-parallel) -> + h

Parameters (:func:`param_layout`; H query heads, G key/value heads of
head_dim D, F the MLP's hidden width, P the size of the axis)::

  attention_norm/scale  [d]              replicated
  attention/q           kernel [d, H*D]   over the axis along H*D
  attention/kv          kernel [d, 2, G*D] along G*D if G % P == 0, else
                                          replicated (its gradient summed)
  attention/out         kernel [H*D, d]   along its rows
  mlp_norm/scale        [d]              replicated
  mlp/gate_up           kernel [d, 2, F]  along F ([:, 0] gate, [:, 1] up)
  mlp/down              kernel [F, d]     along its rows

with ``use_bias`` a bias of each kernel's output shape (q ``[H*D]``, kv
``[2, G*D]``, gate_up ``[2, F]``, out and down ``[d]``). Each shard's q heads
and key/value heads form one column-parallel kernel ``[d, (H/P + 2*G_local)*D]``
(uneven q, k and v widths; the concatenation is a copy of this shard's weights
per step). Split key/value heads pair with this shard's query heads as in
the unsharded model; replicated ones are all computed on every shard, each
shard attending with the ones its query heads use (query head h uses key/value
head ``h // (H/G)``)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import validation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig, check_config
from jax_comm_gemm.fp8 import prologue
from jax_comm_gemm.layers import dense
from jax_comm_gemm.layers.dense import Placement, global_placement
from jax_comm_gemm.layers.gated_mlp import gated_mlp_parallel
from jax_comm_gemm.layers.rotary import apply_rotary, check_head_dim
from jax_comm_gemm.layers import transformer
from jax_comm_gemm.layers.transformer import FP8_LAYERS, ParamSpec
from jax_comm_gemm.runtime.registry import current_plan
from jax_comm_gemm.validation import Names

SCOPE = "sp_llama_block"


@dataclasses.dataclass(frozen=True)
class LlamaOptions:
  """The static settings of a Llama-class block (hashable), each checked on
  construction by an error that names it.

  Attributes:
    num_heads: query heads in all, divisible by the size of the axis.
    num_kv_heads: key/value heads, dividing num_heads (None: num_heads, plain
      multi-head attention; 1: multi-query attention).
    head_dim: each head's width, even (rotary embeddings rotate pairs); None:
      the model width / num_heads.
    activation: the gate's (``jax.nn.silu``: SwiGLU, ``jax.nn.gelu``: GeGLU).
    rope_base: the rotary embeddings' base (Llama 2: 10000, Llama 3: 500000).
    causal: mask attention to earlier positions.
    epsilon: the RMSNorms' epsilon.
    dtype, precision, keep_gathered_input, attention_implementation, config:
      as :class:`~jax_comm_gemm.layers.transformer.BlockOptions`.

  >>> LlamaOptions(num_heads=8, num_kv_heads=3)
  Traceback (most recent call last):
  ...
  ValueError: LlamaOptions: num_kv_heads=3 must divide num_heads=8 (each key/value head serves num_heads / num_kv_heads query heads)
  """
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  activation: Callable = jax.nn.silu
  rope_base: float = 10000.0
  causal: bool = True
  epsilon: float = 1e-5
  dtype: Any = None
  precision: Any = None
  keep_gathered_input: bool = False
  attention_implementation: str | None = None
  config: CommGemmConfig = DEFAULT_CONFIG

  def __post_init__(self):
    op = type(self).__name__
    _check_positive(op, "num_heads", self.num_heads)
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    _check_positive(op, "num_kv_heads", self.num_kv_heads)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{op}: num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads} (each key/value head serves "
                       "num_heads / num_kv_heads query heads)")
    if self.head_dim is not None:
      _check_positive(op, "head_dim", self.head_dim)
      check_head_dim(op, self.head_dim)
    if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, (int, float)) \
        or not self.rope_base > 1:
      raise ValueError(f"{op}: rope_base must be a number > 1, got {self.rope_base!r}")
    validation.check_callable(op, "activation", self.activation)
    check_config(op, self.config)
    object.__setattr__(self, "precision", validation.check_precision(op, self.precision))
    for flag in ("causal", "keep_gathered_input"):
      object.__setattr__(self, flag, validation.check_flag(op, flag, getattr(self, flag)))

  def head_size(self, features: int) -> int:
    """head_dim, or the model width / num_heads."""
    return self.head_dim or features // self.num_heads


def _check_positive(op, name, value):
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")


def kv_split(num_kv_heads: int, size: int) -> bool:
  """Whether the key/value heads split over an axis of `size` (else every
  shard holds them all).

  >>> kv_split(8, 4), kv_split(2, 4)
  (True, False)
  """
  return num_kv_heads % size == 0


def param_layout(features: int, hidden_features: int, options: LlamaOptions, axis_name: str,
                 size: int = 1, use_bias: bool = False) -> dict:
  """The block's parameters as a nested dict of :class:`ParamSpec` (global) on
  an axis of `size` (which decides whether the key/value heads split).

  >>> param_layout(8, 16, LlamaOptions(2, 1), "tp", 2)["attention"]["kv"]["kernel"]
  ParamSpec(shape=(8, 2, 4), names=(None, None, None))
  """
  head_dim = options.head_size(features)
  q, kv = options.num_heads * head_dim, options.num_kv_heads * head_dim
  kv_axis = axis_name if kv_split(options.num_kv_heads, size) else None

  def dense(shape, names, bias_shape, bias_names):
    out = {"kernel": ParamSpec(shape, names)}
    return out | ({"bias": ParamSpec(bias_shape, bias_names)} if use_bias else {})

  norm = {"scale": ParamSpec((features,), (None,))}
  return {"attention_norm": norm,
          "attention": {"q": dense((features, q), (None, axis_name), (q,), (axis_name,)),
                        "kv": dense((features, 2, kv), (None, None, kv_axis), (2, kv),
                                    (None, kv_axis)),
                        "out": dense((q, features), (axis_name, None), (features,), (None,))},
          "mlp_norm": dict(norm),
          "mlp": {"gate_up": dense((features, 2, hidden_features), (None, None, axis_name),
                                   (2, hidden_features), (None, axis_name)),
                  "down": dense((hidden_features, features), (axis_name, None), (features,),
                                (None,))}}


def partition_specs(layout) -> dict:
  """``PartitionSpec`` of each parameter of a :func:`param_layout`."""
  return jax.tree.map(lambda s: P(*s.names), layout)


def init_fp8_histories(options: LlamaOptions):
  """The block's empty FP8 amax histories (``{layer: AmaxHistory}``: "qkv",
  "out", "fc1" (gate and up), "fc2" (down)) where its config's recipe is
  "delayed", else None; as :func:`jax_comm_gemm.layers.transformer.init_fp8_histories`.

  >>> init_fp8_histories(LlamaOptions(2)) is None
  True
  """
  return transformer.init_fp8_histories(options)


# --- local shards -------------------------------------------------------------------

def llama_block(x, params, *, axis_name: str, options: LlamaOptions, fp8_histories=None):
  """The block on local shards, inside ``jax.shard_map`` over `axis_name`:
  ``x`` ``[seq/P, batch, d]``; `params` this shard's slices (cut by
  :func:`partition_specs` of :func:`param_layout` for this axis's size).
  Returns ``[seq/P, batch, d]``.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> o = LlamaOptions(num_heads=2, num_kv_heads=1)
  >>> layout = param_layout(8, 16, o, "tp")
  >>> params = jax.tree.map(lambda s: jnp.ones(s.shape) * 0.1, layout)
  >>> f = jax.shard_map(lambda x, p: llama_block(x, p, axis_name="tp", options=o),
  ...     mesh=mesh, in_specs=(P("tp"), partition_specs(layout)), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((4, 1, 8)), params).shape
  (4, 1, 8)
  """
  names = Names("llama_block")
  validation.check_type(names.op, "options", options, LlamaOptions)
  size = validation.bound_axis_size(names.op, axis_name)
  return block_local(names, x, params, where=Placement(True, axis_name, size),
                     options=options, fp8_histories=fp8_histories)


def block_local(names: Names, x, params, *, where: Placement, options: LlamaOptions,
                fp8_histories=None):
  """:func:`llama_block` for a known placement: checks, then runs."""
  check_block(names.op, names.x, x, params, options, where.axis_name, where.size, local=True)
  return block(x, params, axis_name=where.axis_name, options=options,
               fp8_histories=transformer.checked_histories(names.op, options, fp8_histories),
               plan=current_plan())


def block(x, params, *, axis_name: str, options: LlamaOptions, fp8_histories=None, plan):
  """:func:`llama_block` for callers that checked the arguments, under `plan`,
  the routing plan the entry read (required: nothing below an entry reads it)."""
  o = options
  dtype = o.dtype or jnp.result_type(x, *jax.tree.leaves(params))
  x = x.astype(dtype)
  h = fp8_histories or dict.fromkeys(FP8_LAYERS)
  common = dict(axis_name=axis_name, precision=o.precision, config=o.config, plan=plan)
  with jax.named_scope(SCOPE):
    with jax.named_scope("attention"):
      a = params["attention"]
      q, k, v = _qkv(rms_operands(x, params["attention_norm"], o.epsilon, dtype), a, o,
                     dtype, h["qkv"], **common)
      wo, bo = transformer.dense_params(a["out"], dtype, o.config)
      x = x + dense.row_parallel(_attention(q, k, v, o, axis_name), wo, bo,
                                 fp8_history=h["out"], merge_heads=True, **common)
    with jax.named_scope("mlp"):
      m = params["mlp"]
      (w1, b1), (w2, b2) = (transformer.dense_params(m[name], dtype, o.config)
                            for name in ("gate_up", "down"))
      return x + gated_mlp_parallel(rms_operands(x, params["mlp_norm"], o.epsilon, dtype),
                                    w1, b1, w2, b2, activation=o.activation,
                                    keep_gathered_input=o.keep_gathered_input,
                                    fp8_histories=(h["fc1"], h["fc2"]),
                                    prologue=prologue.rms_norm, **common)


def _qkv(operands, params, o: LlamaOptions, dtype, history, *, axis_name, **common):
  """This shard's q, k, v ``[batch, seq, heads, head_dim]`` from one
  column-parallel op (the RMSNorm applied by it: inside its cast under an FP8
  recipe), rotary embeddings applied at the global positions."""
  (wq, bq), (wkv, bkv) = (transformer.dense_params(params[name], dtype, o.config)
                          for name in ("q", "kv"))
  d = np.shape(wq)[0]
  head_dim = np.shape(wq)[1] // (o.num_heads // jax.lax.axis_size(axis_name))
  kernel = jnp.concatenate([wq, wkv.reshape(d, -1)], axis=1)
  bias = None if bq is None else jnp.concatenate([bq, bkv.reshape(-1)])
  y = dense.column_parallel(operands, kernel, bias, axis_name=axis_name,
                            keep_gathered_input=o.keep_gathered_input, fp8_history=history,
                            prologue=prologue.rms_norm, **common)
  seq, batch = y.shape[:2]
  widths = np.cumsum([np.shape(wq)[1], np.shape(wkv)[2]])
  q, k, v = (jnp.swapaxes(part.reshape(seq, batch, -1, head_dim), 0, 1)
             for part in jnp.split(y, widths, axis=-1))
  positions = jnp.arange(seq)  # the gathered sequence: global positions
  return apply_rotary(q, positions, o.rope_base), apply_rotary(k, positions, o.rope_base), v


def _attention(q, k, v, o: LlamaOptions, axis_name):
  """Attention of this shard's query heads over their key/value heads: those
  of this shard (split), or the ones its query heads use among all (replicated)."""
  size = jax.lax.axis_size(axis_name)
  if not kv_split(o.num_kv_heads, size):
    local = q.shape[2]
    group = o.num_heads // o.num_kv_heads
    index = (jax.lax.axis_index(axis_name) * local + jnp.arange(local)) // group
    k, v = jnp.take(k, index, axis=2), jnp.take(v, index, axis=2)
  return jax.nn.dot_product_attention(q, k, v, is_causal=o.causal,
                                      implementation=o.attention_implementation)


def rms_operands(x, p, epsilon: float, dtype):
  """:func:`rms_norm`'s operands ``(x, rstd, scale)``: x in the wider of its
  dtype and `dtype`, ``rstd = 1/sqrt(mean(x^2) + epsilon)`` ``[..., 1]`` in
  float32 at least, for :func:`jax_comm_gemm.fp8.prologue.rms_norm` (which
  an FP8 cast applies in its own pass)."""
  x = x.astype(jnp.promote_types(x.dtype, dtype))
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + epsilon)
  return x, rstd, p["scale"]


def rms_norm(x, p, epsilon: float, dtype):
  """RMSNorm over the last dimension (``flax.linen.RMSNorm``'s numerics:
  statistics in float32 at least), the result in `dtype`.

  >>> rms_norm(jnp.full((1, 4), 2.0), {"scale": jnp.ones(4)}, 0.0, jnp.float32).tolist()
  [[1.0, 1.0, 1.0, 1.0]]
  """
  return prologue.activated(rms_operands(x, p, epsilon, dtype),
                            prologue.rms_norm).astype(dtype)


# --- global arrays ------------------------------------------------------------------

def sharded_llama_block(x, params, *, mesh=None, axis_name: str = "tp",
                        data_axes: Sequence[str] = (), options: LlamaOptions,
                        op: str = "sharded_llama_block", x_name: str = "x",
                        fp8_histories=None):
  """The block on global arrays: ``x [seq, batch, d]``, the sequence sharded
  over `axis_name` and the batch over `data_axes`; `params` of global shapes,
  sharded as :func:`param_layout` says for the axis's size.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> o = LlamaOptions(num_heads=2)
  >>> params = jax.tree.map(lambda s: jnp.ones(s.shape) * 0.1, param_layout(8, 16, o, "tp"))
  >>> sharded_llama_block(jnp.ones((4, 1, 8)), params, mesh=mesh, options=o).shape
  (4, 1, 8)
  """
  validation.check_type(op, "options", options, LlamaOptions)
  where = global_placement(op, mesh, axis_name, data_axes)
  return block_global(Names(op, x=x_name), x, params, where=where, options=options,
                      fp8_histories=fp8_histories)


def block_global(names: Names, x, params, *, where: Placement, options: LlamaOptions,
                 fp8_histories=None):
  """:func:`sharded_llama_block` for a known placement: checks, then runs."""
  op, data = names.op, where.data_axes
  check_block(op, names.x, x, params, options, where.axis_name, where.size, local=False)
  transformer.check_batch(op, names.x, x, where)
  histories = transformer.checked_histories(op, options, fp8_histories)
  return _sharded(x, params, histories, mesh=where.mesh, axis_name=where.axis_name,
                  data_axes=data, options=options, plan=current_plan())


@partial(jax.jit, static_argnames=("mesh", "axis_name", "data_axes", "options", "plan"))
def _sharded(x, params, histories, *, mesh, axis_name, data_axes, options, plan):
  tokens = P(axis_name, data_axes or None, None)
  layout = param_layout(x.shape[-1], params["mlp"]["down"]["kernel"].shape[0], options,
                        axis_name, mesh.shape[axis_name], "bias" in params["attention"]["q"])

  def body(x, params, histories):
    return block(x, params, axis_name=axis_name, options=options, fp8_histories=histories,
                 plan=plan)

  specs = (tokens, partition_specs(layout), None if histories is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(x, params, histories)


# --- checks -------------------------------------------------------------------------

def check_block(op: str, x_name: str, x, params, options: LlamaOptions, axis_name: str,
                size: int, *, local: bool) -> None:
  """`x` ``[seq, batch, d]`` (local: ``[seq/P, ...]``), `params` shaped as
  :func:`param_layout` says (local: cut by `size`), query heads split over the axis.

  >>> check_block("f", "x", jnp.ones((4, 1, 6)), {}, LlamaOptions(4), "tp", 1, local=False)
  Traceback (most recent call last):
  ...
  ValueError: f: the features (6) must divide into num_heads=4 heads of equal size (or pass head_dim)
  """
  d = transformer.check_activations(op, x_name, x, axis_name, size, local=local)
  if options.head_dim is None:
    if d % options.num_heads:
      raise ValueError(f"{op}: the features ({d}) must divide into "
                       f"num_heads={options.num_heads} heads of equal size (or pass head_dim)")
    check_head_dim(op, d // options.num_heads)
  validation.check_divisible(op, "num_heads", "heads", options.num_heads, axis_name, size,
                             ": each shard computes whole query heads")
  try:
    hidden = np.shape(params["mlp"]["down"]["kernel"])[0] * (size if local else 1)
    layout = param_layout(d, hidden, options, axis_name, size,
                          "bias" in params["attention"]["q"])
  except (KeyError, TypeError, IndexError):
    raise ValueError(f"{op}: `params` must be a dict shaped as llama.param_layout() says "
                     "(attention_norm, attention/{q,kv,out}, mlp_norm, "
                     "mlp/{gate_up,down})") from None
  validation.check_divisible(op, "mlp/down/kernel", "input features", hidden, axis_name, size)
  transformer.check_param_shapes(op, params, layout, size, d, local=local)
