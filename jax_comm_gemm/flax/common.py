"""What the linen and NNX modules share: the table of their options
(:class:`Options`, inherited by the linen modules as keyword-only fields and
spelled out as keyword-only arguments by the NNX modules), the checks of those options, why a
dense layer leaves the fused path, and :func:`run`, the one local-or-global
dispatch to the layers."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import initializers
from flax.typing import Dtype, Initializer, PrecisionLike

from jax_comm_gemm import validation
from jax_comm_gemm.backends.routes import init_config
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig, check_config
from jax_comm_gemm.layers import dense, llama, transformer
from jax_comm_gemm.validation import Names

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros_init()
default_scale_init = initializers.ones_init()  # the norms' scales


@dataclasses.dataclass(frozen=True)
class Options:
  """The options every module takes (keyword-only), with their defaults.

  Attributes:
    axis_name: the tensor-parallel mesh axis.
    mesh: the mesh in global mode; None takes the one set by ``jax.set_mesh``.
    data_axes: mesh axes that also shard the tokens (the batch, for the
      transformer block): a name or a sequence of names. Every other mesh axis
      of size > 1 must be among them (else a ValueError naming ``data_axes``).
    use_bias: whether the dense layers add a bias.
    dtype: the dtype of the computation (default: from inputs and params, as
      Flax's ``promote_dtype``).
    param_dtype: the dtype passed to the initializers.
    precision: as ``lax.dot_general`` takes it, for every GEMM of the layer.
    kernel_init, bias_init: initializers of the kernels (global shapes) and biases.
    config: a :class:`~jax_comm_gemm.CommGemmConfig`: backend and algorithms."""
  axis_name: str = "tp"
  mesh: jax.sharding.Mesh | None = None
  data_axes: Sequence[str] = ()
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = default_bias_init
  config: CommGemmConfig = DEFAULT_CONFIG


DEFAULTS = MappingProxyType({f.name: f.default for f in dataclasses.fields(Options)})


def kw_only(default):
  """A keyword-only linen field with `default`."""
  return dataclasses.field(default=default, kw_only=True)


# The linen modules' base: every field of Options, keyword-only, so that each
# module's own positional fields (features, ...) come first.
LinenOptions = type("LinenOptions", (nn.Module,), {
    "__module__": __name__,
    "__doc__": "A linen module with :class:`Options`' fields (keyword-only).",
    "__annotations__": {f.name: f.type for f in dataclasses.fields(Options)},
    **{f.name: kw_only(f.default) for f in dataclasses.fields(Options)}})


def options_of(module) -> dict:
  """The table's options as `module` (linen or NNX) holds them."""
  return {name: getattr(module, name) for name in DEFAULTS}


def check_options(owner: str, options: dict, *, features: dict[str, int]) -> tuple:
  """Checks a module's options and sizes, each error naming its field; returns
  the data axes as a tuple (`options` keeps the checked precision). With a
  mesh given, its axes are checked too.

  >>> check_options("M", DEFAULTS | {"data_axes": "dp"}, features={"features": 4})
  ('dp',)
  >>> check_options("M", DEFAULTS | {"config": "xla"}, features={})
  Traceback (most recent call last):
  ...
  TypeError: M: `config` must be a jax_comm_gemm.CommGemmConfig, got 'xla' (str); e.g. config=CommGemmConfig(backend='xla')
  """
  for field, value in features.items():
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{owner}.{field} must be a positive int, got {value!r}")
  check_config(owner, options["config"])
  validation.check_flag(owner, "use_bias", options["use_bias"])
  options["precision"] = validation.check_precision(owner, options["precision"])
  for name in ("keep_gathered_input", "causal"):
    if name in options:
      validation.check_flag(owner, name, options[name])
  for name in ("activation", "kernel_init", "bias_init", "scale_init"):
    if name in options:
      validation.check_callable(owner, name, options[name])
  data = dense.as_axes(owner, options["axis_name"], options["data_axes"])
  if options["mesh"] is not None:
    dense.check_mesh(owner, dense.resolve_mesh(owner, options["mesh"]),
                         options["axis_name"], data)
  return data


def check_split(subject: str, value: int, axis_name: str, size: int) -> None:
  """`subject` (such as ``"ColumnParallelDense.features"``) must split over the axis.

  >>> check_split("M.features", 6, "tp", 4)
  Traceback (most recent call last):
  ...
  ValueError: M.features=6 is not divisible by the size 4 of the tensor-parallel mesh axis 'tp'
  """
  if value % size:
    raise ValueError(
        f"{subject}={value} is not divisible by the size {size} of the "
        f"tensor-parallel mesh axis {axis_name!r}")


def check_token_inputs(owner: str, inputs, where: dense.Placement) -> None:
  """A module's `inputs`, sharded along tokens: at least 2-D, and globally the
  tokens split over every shard."""
  validation.check_activations(owner, "inputs", inputs)
  if not where.local:
    validation.check_tokens(owner, "inputs", jnp.shape(inputs),
                            "*".join((*where.data_axes, where.axis_name)), where.shards)


def path_reason(kind: str, injected: str | None, preferred_element_type=None) -> str | None:
  """Why a dense layer of `kind` (``"column"`` or ``"row"``) runs on XLA's
  collectives rather than on the configured backend, or None where the backend
  decides (the usual case). `injected` names the injected argument, if any.

  >>> path_reason("column", None) is None
  True
  >>> path_reason("row", "dot_general")
  "dot_general is injected: the fused kernels cannot call it, so the layer runs on XLA's collectives (the dot, then lax.psum_scatter)"
  """
  if injected is not None:
    why = f"{injected} is injected: the fused kernels cannot call it"
  elif preferred_element_type is not None:
    why = (f"preferred_element_type={jnp.dtype(preferred_element_type).name} is set: the "
           "fused kernels write the computation dtype")
  else:
    return None
  steps = ("lax.all_gather, then the dot" if kind == "column"
           else "the dot, then lax.psum_scatter")
  return f"{why}, so the layer runs on XLA's collectives ({steps})"


def config_of(module) -> CommGemmConfig:
  """The linen `module`'s config as ``routes.init_config`` routes it (on XLA's
  collectives while flax initializes the module)."""
  return init_config(module.config, module.is_initializing())


def run(kind: str, where: dense.Placement, names: Names, *operands, **options):
  """Runs layer `kind` ("column", "row", "block" or "llama") where `where`
  says: on local shards inside the caller's ``jax.shard_map``, or on global arrays."""
  if kind == "llama":
    run_block = llama.block_local if where.local else llama.block_global
    return run_block(names, *operands, where=where, **options)
  if kind == "column" and where.local:
    return dense.column_local(names, *operands, where=where, **options)
  if kind == "column":
    return dense.column_global(names, *operands, where=where, **options)
  if kind == "row" and where.local:
    return dense.row_local(names, *operands, where=where, **options)
  if kind == "row":
    return dense.row_global(names, *operands, where=where, **options)
  if where.local:
    return transformer.block_local(names, *operands, where=where, **options)
  return transformer.block_global(names, *operands, where=where, **options)
