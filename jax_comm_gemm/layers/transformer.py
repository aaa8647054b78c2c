"""A sequence-parallel transformer block (Megatron's arrangement): the local
core, inside ``jax.shard_map``, and its global-array wrapper.
Longer than 300 lines because every public function carries a runnable example.

Activations are ``[seq, batch, features]``, the sequence sharded over the
tensor-parallel axis between blocks (and, globally, the batch over the data
axes)::

  x -> LayerNorm -> QKV (column-parallel) -> attention over this shard's heads
    -> out-proj (row-parallel) -> + x = h
  h -> LayerNorm -> fc1 (column-parallel) -> activation -> fc2 (row-parallel) -> + h

The QKV kernel's columns are ordered ``(head, {q, k, v}, head_dim)``, so a
column shard holds whole heads whatever P is. Parameters (:func:`param_layout`)::

  ln_1, ln_2           scale, bias [d]           replicated
  attention/qkv        kernel [d, 3d], bias [3d]  over axis_name along 3d
  attention/out        kernel [d, d],  bias [d]   kernel along its rows
  mlp/fc1              kernel [d, F],  bias [F]   over axis_name along F
  mlp/fc2              kernel [F, d],  bias [d]   kernel along its rows"""

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
from jax_comm_gemm.fp8 import AmaxHistory, prologue
from jax_comm_gemm.fp8.heads import merge_heads, split_heads
from jax_comm_gemm.layers import dense
from jax_comm_gemm.layers.dense import Placement, global_placement
from jax_comm_gemm.runtime.registry import current_plan
from jax_comm_gemm.validation import Names

SCOPE = "sp_transformer_block"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One parameter: its global shape and the mesh axis of each dimension."""
  shape: tuple[int, ...]
  names: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  """The static settings of a block (hashable: jit and shard_map key on them),
  each checked on construction by an error that names it.

  Attributes:
    num_heads: attention heads in all, divisible by the size of the axis.
    activation: the MLP's activation.
    causal: mask attention to earlier positions.
    epsilon: the LayerNorms' epsilon (as ``flax.linen.LayerNorm``).
    dtype: the computation dtype (None: promote the inputs and parameters).
    precision: of every dense GEMM that XLA runs (not attention's own products).
    keep_gathered_input: QKV and fc1 keep their gathered input for the weight
      gradient (``seq*b*d`` memory each).
    attention_implementation: ``jax.nn.dot_product_attention``'s
      ``implementation`` (None: jax chooses).
    config: backend and algorithm choices.

  >>> BlockOptions(num_heads=4, activation=None)
  Traceback (most recent call last):
  ...
  TypeError: BlockOptions: `activation` must be a function (e.g. jax.nn.gelu), got None
  """
  num_heads: int
  activation: Callable = jax.nn.gelu
  causal: bool = True
  epsilon: float = 1e-6
  dtype: Any = None
  precision: Any = None
  keep_gathered_input: bool = False
  attention_implementation: str | None = None
  config: CommGemmConfig = DEFAULT_CONFIG

  def __post_init__(self):
    op = type(self).__name__
    validation.check_callable(op, "activation", self.activation)
    check_config(op, self.config)
    object.__setattr__(self, "precision", validation.check_precision(op, self.precision))
    for flag in ("causal", "keep_gathered_input"):
      object.__setattr__(self, flag, validation.check_flag(op, flag, getattr(self, flag)))


def param_layout(features: int, hidden_features: int, axis_name: str,
                 use_bias: bool = True) -> dict:
  """The block's parameters as a nested dict of :class:`ParamSpec` (global).

  >>> param_layout(8, 16, "tp")["mlp"]["fc1"]["kernel"]
  ParamSpec(shape=(8, 16), names=(None, 'tp'))
  """

  def dense(k, f, split):
    kernel = ParamSpec((k, f), (None, axis_name) if split == 1 else (axis_name, None))
    if not use_bias:
      return {"kernel": kernel}
    return {"kernel": kernel, "bias": ParamSpec((f,), (axis_name if split == 1 else None,))}

  norm = {"scale": ParamSpec((features,), (None,)), "bias": ParamSpec((features,), (None,))}
  return {"ln_1": norm,
          "attention": {"qkv": dense(features, 3 * features, 1),
                        "out": dense(features, features, 0)},
          "ln_2": dict(norm),
          "mlp": {"fc1": dense(features, hidden_features, 1),
                  "fc2": dense(hidden_features, features, 0)}}


def partition_specs(params, axis_name: str) -> dict:
  """``PartitionSpec`` of each parameter in `params` (a block's parameter dict).

  >>> specs = partition_specs({"attention": {"qkv": {"kernel": 0}}}, "tp")
  >>> specs["mlp"]["fc2"]["kernel"] == P("tp", None)
  True
  """
  layout = param_layout(1, 1, axis_name, "bias" in params["attention"]["qkv"])
  return jax.tree.map(lambda s: P(*s.names), layout)


# The dense layers whose FP8 amax histories a "delayed" block carries.
FP8_LAYERS = ("qkv", "out", "fc1", "fc2")


def init_fp8_histories(options: BlockOptions):
  """A block's empty FP8 amax histories (``{layer: AmaxHistory}``) where its
  config's recipe is "delayed", else None. Pass them as ``fp8_histories``; the
  block's gradient with respect to them is the next step's (replace, do not
  apply: ``AmaxHistory``).

  >>> init_fp8_histories(BlockOptions(2)) is None
  True
  """
  recipe = options.config.fp8
  if recipe is None or recipe.scaling != "delayed":
    return None
  return {name: AmaxHistory.zeros(recipe) for name in FP8_LAYERS}


# --- local shards -------------------------------------------------------------------

def transformer_block(x, params, *, axis_name: str, options: BlockOptions,
                      fp8_histories=None):
  """The block on local shards, inside ``jax.shard_map`` over `axis_name`.

  ``x`` is ``[seq/P, batch, d]``; `params` holds this shard's slices of the
  parameters (cut by :func:`partition_specs`); `fp8_histories`: a "delayed"
  FP8 config's (:func:`init_fp8_histories`). Returns ``[seq/P, batch, d]``.

  >>> import numpy as np; from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> params = jax.tree.map(lambda s: jnp.ones(s.shape), param_layout(8, 16, "tp"))
  >>> f = jax.shard_map(lambda x, p: transformer_block(
  ...     x, p, axis_name="tp", options=BlockOptions(num_heads=2)), mesh=mesh,
  ...     in_specs=(P("tp"), partition_specs(params, "tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((4, 1, 8)), params).shape
  (4, 1, 8)
  """
  names = Names("transformer_block")
  validation.check_type(names.op, "options", options, BlockOptions)
  size = validation.bound_axis_size(names.op, axis_name)
  return block_local(names, x, params, where=Placement(True, axis_name, size),
                     options=options, fp8_histories=fp8_histories)


def block_local(names: Names, x, params, *, where: Placement, options: BlockOptions,
                fp8_histories=None):
  """:func:`transformer_block` for a known placement: checks, then runs."""
  check_block(names.op, names.x, x, params, options.num_heads, where.axis_name, where.size,
              local=True)
  return block(x, params, axis_name=where.axis_name, options=options,
               fp8_histories=checked_histories(names.op, options, fp8_histories),
               plan=current_plan())


def block(x, params, *, axis_name: str, options: BlockOptions, fp8_histories=None, plan):
  """:func:`transformer_block` for callers that checked the arguments, under
  `plan`, the routing plan the entry read (required: nothing below an entry reads it)."""
  o = options
  dtype = o.dtype or jnp.result_type(x, *jax.tree.leaves(params))
  x = x.astype(dtype)
  sublayer = partial(_sublayer, axis_name=axis_name, options=o, dtype=dtype, plan=plan)
  h = fp8_histories or dict.fromkeys(FP8_LAYERS)
  with jax.named_scope(SCOPE):
    with jax.named_scope("attention"):
      x = sublayer(x, params["ln_1"], params["attention"]["qkv"], params["attention"]["out"],
                   inner=partial(attention_heads, causal=o.causal,
                                 implementation=o.attention_implementation),
                   head_dim=x.shape[-1] // o.num_heads, histories=(h["qkv"], h["out"]))
    with jax.named_scope("mlp"):
      return sublayer(x, params["ln_2"], params["mlp"]["fc1"], params["mlp"]["fc2"],
                      histories=(h["fc1"], h["fc2"]))


def _sublayer(x, norm, first, second, *, inner=None, head_dim=None, axis_name, options, dtype,
              histories, plan):
  """``x + second(inner(first(LayerNorm(x))))``: a column-parallel then a
  row-parallel dense around `inner` (attention, of q, k and v in its own
  layout, :func:`attention_heads`); without one, the MLP
  (:func:`dense.mlp_parallel`: under an FP8 recipe one op for both layers)."""
  o = options
  # The LayerNorm's output is the first dense's input: the dense applies it
  # (under an FP8 recipe inside its cast, never written in bf16).
  h = normalization(x, norm, o.epsilon, dtype)
  (k1, b1), (k2, b2) = (dense_params(p, dtype, o.config) for p in (first, second))
  if inner is None:
    return x + dense.mlp_parallel(h, k1, b1, k2, b2, axis_name=axis_name,
                                  activation=o.activation,
                                  keep_gathered_input=o.keep_gathered_input,
                                  precision=o.precision, config=o.config,
                                  fp8_histories=histories, prologue=prologue.layer_norm,
                                  plan=plan)
  # Attention's arrays [batch, seq, heads, head_dim] leave the first dense and
  # enter the second as they are: an FP8 cast reads them there (docs/fp8.md).
  q, k, v = dense.column_parallel(h, k1, b1, axis_name=axis_name,
                                  keep_gathered_input=o.keep_gathered_input,
                                  precision=o.precision, config=o.config,
                                  fp8_history=histories[0], prologue=prologue.layer_norm,
                                  split_heads=(3, head_dim), plan=plan)
  return x + dense.row_parallel(inner(q, k, v), k2, b2, axis_name=axis_name,
                                precision=o.precision, config=o.config,
                                fp8_history=histories[1], merge_heads=True, plan=plan)


def checked_histories(op, options, fp8_histories):
  """`fp8_histories`, checked: {layer: AmaxHistory} for FP8_LAYERS where the
  config's recipe is "delayed", else None."""
  return validation.check_fp8_histories(op, options.config, fp8_histories, FP8_LAYERS,
                                        "init_fp8_histories(options)")


def layer_norm(x, p, epsilon: float, dtype):
  """``flax.linen.LayerNorm`` over the last dimension, step for step: statistics
  in float32 at least, ``var = E[x^2] - E[x]^2``, the result in `dtype`.

  >>> layer_norm(jnp.arange(4.0)[None], {"scale": 1.0, "bias": 0.0}, 1e-6, jnp.float32).shape
  (1, 4)
  """
  return prologue.activated(normalization(x, p, epsilon, dtype),
                            prologue.layer_norm).astype(dtype)


def normalization(x, p, epsilon: float, dtype):
  """:func:`layer_norm`'s operands: ``(x, mean, rstd, scale, bias)``, x in the
  wider of its dtype and `dtype`, the row statistics ``[..., 1]``, for
  :func:`jax_comm_gemm.fp8.prologue.layer_norm` (which an FP8 cast applies in
  its own pass)."""
  x = x.astype(jnp.promote_types(x.dtype, dtype))
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean = jnp.mean(xf, -1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(jnp.square(xf), -1, keepdims=True) - jnp.square(mean))
  return x, mean, jax.lax.rsqrt(var + epsilon), p["scale"], p["bias"]


def attention(qkv, heads: int, causal: bool, implementation):
  """Attention over whole sequences for `heads` local heads: ``qkv`` is
  ``[seq, b, heads * 3 * head_dim]`` (columns ``(head, {q,k,v}, head_dim)``);
  returns ``[seq, b, heads * head_dim]``.

  >>> attention(jnp.ones((4, 1, 2 * 3 * 4)), heads=2, causal=True, implementation=None).shape
  (4, 1, 8)
  """
  q, k, v = split_heads(qkv, 3, qkv.shape[-1] // (3 * heads))
  return merge_heads(attention_heads(q, k, v, causal, implementation))


def attention_heads(q, k, v, causal: bool, implementation):
  """Attention over whole sequences of q, k and v in its own layout, ``[b,
  seq, heads, head_dim]`` (:func:`jax_comm_gemm.fp8.heads.split_heads`); the
  result in the same."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                      implementation=implementation)


def dense_params(p, dtype, config):
  """(kernel, bias or None) in the computation dtype, like flax's promote_dtype;
  under an FP8 recipe the kernel as stored: the FP8 op makes its FP8 copies
  from it in one read and returns its gradient in its dtype, where a copy in
  `dtype` of a float32 master weight would cost a pass over it, and one over
  its gradient, every step (docs/fp8.md)."""
  kernel = p["kernel"] if config.fp8 is not None else p["kernel"].astype(dtype)
  return kernel, (p["bias"].astype(dtype) if "bias" in p else None)


# --- global arrays ------------------------------------------------------------------

def sharded_transformer_block(x, params, *, mesh=None, axis_name: str = "tp",
                              data_axes: Sequence[str] = (), options: BlockOptions,
                              op: str = "sharded_transformer_block", x_name: str = "x",
                              fp8_histories=None):
  """The block on global arrays: ``x [seq, batch, d]`` with the sequence sharded
  over `axis_name` and the batch over `data_axes`; `params` with global shapes,
  sharded as :func:`partition_specs` says. Returns an array of ``x``'s shape and
  sharding. `op` and `x_name` are what errors call things; `fp8_histories` as
  in :func:`transformer_block`.

  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> params = jax.tree.map(lambda s: jnp.ones(s.shape), param_layout(8, 16, "tp"))
  >>> sharded_transformer_block(jnp.ones((4, 1, 8)), params, mesh=mesh,
  ...                           options=BlockOptions(num_heads=2)).shape
  (4, 1, 8)
  """
  validation.check_type(op, "options", options, BlockOptions)
  where = global_placement(op, mesh, axis_name, data_axes)
  return block_global(Names(op, x=x_name), x, params, where=where, options=options,
                      fp8_histories=fp8_histories)


def block_global(names: Names, x, params, *, where: Placement, options: BlockOptions,
                 fp8_histories=None):
  """:func:`sharded_transformer_block` for a known placement: checks, then runs."""
  op, data = names.op, where.data_axes
  check_block(op, names.x, x, params, options.num_heads, where.axis_name, where.size,
              local=False)
  check_batch(op, names.x, x, where)
  histories = checked_histories(op, options, fp8_histories)
  return _sharded(x, params, histories, mesh=where.mesh, axis_name=where.axis_name,
                  data_axes=data, options=options, plan=current_plan())


# Keyed on the routing plan in force too: a trace under an older plan (before
# connect or autotune) is never reused for a call under a newer one.
@partial(jax.jit, static_argnames=("mesh", "axis_name", "data_axes", "options", "plan"))
def _sharded(x, params, histories, *, mesh, axis_name, data_axes, options, plan):
  tokens = P(axis_name, data_axes or None, None)

  def body(x, params, histories):
    return block(x, params, axis_name=axis_name, options=options, fp8_histories=histories,
                 plan=plan)

  specs = (tokens, partition_specs(params, axis_name), None if histories is None else P())
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tokens)(x, params, histories)


# --- checks -------------------------------------------------------------------------

def check_block(op: str, x_name: str, x, params, num_heads: int, axis_name: str,
                size: int, *, local: bool) -> None:
  """`x` ``[seq, batch, d]`` (local: ``[seq/P, ...]``), `params` shaped as
  :func:`param_layout` says (local: cut by `size`), heads split over the axis.

  >>> params = jax.tree.map(lambda s: jnp.ones(s.shape), param_layout(8, 16, "tp"))
  >>> check_block("f", "x", jnp.ones((4, 1, 8)), params, 3, "tp", 1, local=False)
  Traceback (most recent call last):
  ...
  ValueError: f: the features (8) must divide into num_heads=3 heads of equal size
  """
  d = check_activations(op, x_name, x, axis_name, size, local=local)
  if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
    raise ValueError(f"{op}: num_heads must be a positive int, got {num_heads!r}")
  if d % num_heads:
    raise ValueError(f"{op}: the features ({d}) must divide into num_heads={num_heads} "
                     "heads of equal size")
  validation.check_divisible(op, "num_heads", "heads", num_heads, axis_name, size,
                             ": each shard computes whole heads")
  try:
    hidden = np.shape(params["mlp"]["fc2"]["kernel"])[0] * (size if local else 1)
    layout = param_layout(d, hidden, axis_name, "bias" in params["attention"]["qkv"])
  except (KeyError, TypeError, IndexError):
    raise ValueError(f"{op}: `params` must be a dict shaped as param_layout() says "
                     "(ln_1, attention/{qkv,out}, ln_2, mlp/{fc1,fc2})") from None
  validation.check_divisible(op, "mlp/fc1/kernel", "output features", hidden, axis_name,
                             size)
  check_param_shapes(op, params, layout, size, d, local=local)


def check_activations(op: str, x_name: str, x, axis_name: str, size: int, *,
                      local: bool) -> int:
  """A block's `x`: 3-D ``[seq, batch, d]``, globally its sequence split over
  the axis; returns d."""
  shape = np.shape(x)
  if len(shape) != 3:
    raise ValueError(
        f"{op}: `{x_name}` must be 3-D [seq, batch, features] (the sequence first: "
        f"it is sharded over {axis_name!r}), got shape {shape}")
  if not local:
    validation.check_divisible(
        op, x_name, "positions (first dimension, the sequence)", shape[0], axis_name, size,
        ". The layout is [seq, batch, features]: for [batch, seq, features] "
        "activations pass jnp.swapaxes(x, 0, 1)")
  validation.check_not_empty(op, x_name, x)
  validation.check_dtype(op, x_name, x)
  return shape[-1]


def check_batch(op: str, x_name: str, x, where: Placement) -> None:
  """A global block's batch (`x`'s second dimension) splits over the data axes."""
  data = where.data_axes
  shards = int(np.prod([where.mesh.shape[a] for a in data]))
  validation.check_divisible(op, x_name, "sequences (second dimension, the batch)",
                             np.shape(x)[1], "*".join(data) or "()", shards)


def check_param_shapes(op: str, params, layout, size: int, d: int, *, local: bool) -> None:
  """`params` has `layout`'s entries (a dict of :class:`ParamSpec`), each of
  its global shape, or locally of its shape cut by `size` along the axis."""
  want = jax.tree.map(lambda s: tuple(n // size if name is not None and local else n
                                      for n, name in zip(s.shape, s.names)), layout)
  got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
  if (jax.tree.structure(got, is_leaf=_is_shape)
      != jax.tree.structure(want, is_leaf=_is_shape)):
    raise ValueError(f"{op}: `params` has entries {_paths(got)}, expected {_paths(want)}")
  for path, shape_got, shape_want in zip(_paths(got), jax.tree.leaves(got, is_leaf=_is_shape),
                                         jax.tree.leaves(want, is_leaf=_is_shape)):
    if shape_got != shape_want:
      where = "local shard" if local else "global shape"
      raise ValueError(f"{op}: `params` {path} has shape {tuple(shape_got)}, expected "
                       f"{shape_want} ({where}, model width {d})")


def _is_shape(v) -> bool:
  return isinstance(v, tuple) and all(isinstance(n, (int, np.integer)) for n in v)


def _paths(tree) -> list[str]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_shape)
  return ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
