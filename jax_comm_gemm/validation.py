"""Argument checks, run at trace time before any device work: every error names
the argument and says what is allowed. The module imports no other module of
the package, so that every layer, the FP8 ops included, checks through it.
Longer than 300 lines: it is the one home of the package's argument checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                    jnp.dtype(jnp.float32))
_DTYPE_NAMES = "bfloat16, float16, float32"


@dataclasses.dataclass(frozen=True)
class Names:
  """What errors call the operation and its arguments: the names the user
  wrote (a Flax module passes its class and ``inputs``).

  >>> check_bias(Names("RowParallelDense", x="inputs"), np.ones(4, "f4"), 4, np.ones((2, 3), "f2"))
  Traceback (most recent call last):
  ...
  TypeError: RowParallelDense: `bias` has dtype float32 but `inputs` has float16; cast the bias (bias.astype(inputs.dtype))
  """
  op: str
  x: str = "x"
  kernel: str = "kernel"
  bias: str = "bias"


def check_axis_name(op: str, axis_name) -> None:
  """`axis_name` must be a mesh axis name: a str.

  >>> check_axis_name("f", 0)
  Traceback (most recent call last):
  ...
  TypeError: f: axis_name must be a mesh axis name (str), got 0
  """
  if not isinstance(axis_name, str):
    raise TypeError(f"{op}: axis_name must be a mesh axis name (str), got {axis_name!r}")


def bound_axis_size(op: str, axis_name) -> int:
  """The size of `axis_name` in the enclosing shard_map, or a clear error.

  >>> bound_axis_size("f", "tp")
  Traceback (most recent call last):
  ...
  ValueError: f: axis_name='tp' is not an axis of the enclosing jax.shard_map (no mesh axis is bound here); call it inside jax.shard_map over a mesh with that axis, or use the Flax modules, which take a mesh
  """
  check_axis_name(op, axis_name)
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    where = (f"the enclosing mesh has axes {names}" if names else
             "no mesh axis is bound here")
    raise ValueError(
        f"{op}: axis_name={axis_name!r} is not an axis of the enclosing "
        f"jax.shard_map ({where}); call it inside jax.shard_map over a mesh "
        "with that axis, or use the Flax modules, which take a mesh") from None


def mesh_axis_size(op: str, mesh, axis_name) -> int:
  """The size of `axis_name` in `mesh`, or a clear error."""
  check_axis_name(op, axis_name)
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"{op}: axis_name={axis_name!r} is not an axis of the mesh, whose "
        f"axes are {tuple(mesh.axis_names)}")
  return int(mesh.shape[axis_name])


def check_dtype(op: str, name: str, value) -> None:
  """`value`'s dtype must be one the layers run."""
  dtype = jnp.result_type(value)
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{op}: `{name}` has dtype {dtype}; supported dtypes are {_DTYPE_NAMES}")


def check_rank(op: str, name: str, value, rank: int, what: str) -> None:
  """`value` must have `rank` dimensions, none of them empty.

  >>> check_rank("f", "w", np.ones((0, 2)), 2, "[in, out]")
  Traceback (most recent call last):
  ...
  ValueError: f: `w` has shape (0, 2), with a dimension of size 0; every dimension must be at least 1
  """
  if np.ndim(value) != rank:
    raise ValueError(
        f"{op}: `{name}` must be {rank}-D {what}, got shape {np.shape(value)}")
  check_not_empty(op, name, value)


def check_not_empty(op: str, name: str, value) -> None:
  """No dimension of `value` may be 0: the collectives cannot split nothing."""
  if 0 in np.shape(value):
    raise ValueError(
        f"{op}: `{name}` has shape {np.shape(value)}, with a dimension of size 0; "
        "every dimension must be at least 1")


def _precisions(precision):
  """`precision` as a pair of lax.Precision, or None where it names none."""
  pair = precision if isinstance(precision, (tuple, list)) and len(precision) == 2 else None
  for kind in (lax.Precision, str):  # jax takes a pair of one kind
    if isinstance(precision, kind) or (pair and all(isinstance(p, kind) for p in pair)):
      try:
        return tuple(lax.Precision(p) for p in (pair or (precision, precision)))
      except ValueError:
        return None
  return None


def check_precision(op: str, precision):
  """`precision` as ``lax.dot_general`` takes it (a list pair as a tuple: jit
  keys on it), else a ValueError.

  >>> check_precision("f", ("highest", "default"))
  ('highest', 'default')
  >>> check_precision("f", "best")
  Traceback (most recent call last):
  ...
  ValueError: f: `precision` must be None, a jax.lax.Precision or its name ('highest', 'float32', 'high', 'bfloat16_3x', 'tensorfloat32', 'default', 'bfloat16', 'fastest'), a pair of either kind, or a jax.lax.DotAlgorithmPreset, its name, or a jax.lax.DotAlgorithm, as jax.lax.dot_general takes it; got 'best'
  """
  if (precision is None or isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset))
      or (isinstance(precision, str) and precision in lax.DotAlgorithmPreset.__members__)
      or _precisions(precision) is not None):
    return tuple(precision) if isinstance(precision, list) else precision
  names = ("highest", "float32", "high", "bfloat16_3x", "tensorfloat32", "default",
           "bfloat16", "fastest")
  raise ValueError(
      f"{op}: `precision` must be None, a jax.lax.Precision or its name {names}, a pair "
      "of either kind, or a jax.lax.DotAlgorithmPreset, its name, or a "
      f"jax.lax.DotAlgorithm, as jax.lax.dot_general takes it; got {precision!r}")


def default_precision(precision) -> bool:
  """Whether a checked `precision` asks for nothing but jax's default.

  >>> default_precision(None), default_precision("bfloat16"), default_precision("highest")
  (True, True, False)
  """
  return (precision is None or precision in (lax.DotAlgorithmPreset.DEFAULT, "DEFAULT")
          or _precisions(precision) == (lax.Precision.DEFAULT,) * 2)


def check_precision_used(op: str, precision, why_ignored: str) -> None:
  """A ValueError where `precision` asks for more than the default and the
  path it reaches would ignore it (`why_ignored`)."""
  if not default_precision(precision):
    raise ValueError(f"{op}: precision={precision!r} would be ignored: {why_ignored}; "
                     "leave precision unset there")


def check_callable(op: str, name: str, value) -> None:
  """`value` (an activation, a dot_general) must be callable.

  >>> check_callable("f", "activation", None)
  Traceback (most recent call last):
  ...
  TypeError: f: `activation` must be a function (e.g. jax.nn.gelu), got None
  """
  if not callable(value):
    raise TypeError(f"{op}: `{name}` must be a function (e.g. jax.nn.gelu), got {value!r}")


def check_matmul(op: str, x, w, *, transpose_w, x_name: str = "x",
                 w_name: str = "w") -> tuple[int, int]:
  """A local x [tokens, k] against w [k, m] (or [m, k] when transposed); returns (k, m)."""
  if not isinstance(transpose_w, (bool, np.bool_)):
    raise TypeError(f"{op}: transpose_w must be a bool, got {transpose_w!r}")
  check_rank(op, x_name, x, 2, "[tokens, features]")
  w_layout = "[out_features, in_features]" if transpose_w else "[in_features, out_features]"
  check_rank(op, w_name, w, 2, w_layout)
  check_same_dtype(op, x_name, x, w_name, w)
  k = np.shape(x)[1]
  w_k, m = (np.shape(w)[1], np.shape(w)[0]) if transpose_w else np.shape(w)
  check_inner(op, f"`{x_name}`", k, f"`{w_name}` {w_layout}", w_k, np.shape(w))
  return k, m


def check_same_dtype(op: str, a_name: str, a, b_name: str, b) -> None:
  """`a` and `b` must both be of a dtype the layers run, and the same one.

  >>> check_same_dtype("f", "x", np.ones(2, np.float32), "w", np.ones(2, np.float16))
  Traceback (most recent call last):
  ...
  TypeError: f: `x` (float32) and `w` (float16) must have the same dtype; cast one of them
  """
  check_dtype(op, a_name, a)
  check_dtype(op, b_name, b)
  if jnp.result_type(a) != jnp.result_type(b):
    raise TypeError(
        f"{op}: `{a_name}` ({jnp.result_type(a)}) and `{b_name}` "
        f"({jnp.result_type(b)}) must have the same dtype; cast one of them")


def check_inner(op: str, x_name: str, k: int, w_name: str, w_k: int, w_shape) -> None:
  """The input's `k` features must be the weight's `w_k` input features.

  >>> check_inner("f", "the input", 3, "`w`", 4, (4, 2))
  Traceback (most recent call last):
  ...
  ValueError: f: inner dimensions differ: the input has 3 features but `w` has 4 input features (shape (4, 2))
  """
  if k != w_k:
    raise ValueError(f"{op}: inner dimensions differ: {x_name} has {k} features but "
                     f"{w_name} has {w_k} input features (shape {tuple(w_shape)})")


def check_divisible(op: str, name: str, what: str, size: int, axis_name: str,
                    axis_size: int, hint: str = "") -> None:
  """`size` (of `name`'s `what`) must split evenly over the axis."""
  if size % axis_size:
    raise ValueError(
        f"{op}: `{name}` has {size} {what}, which is not divisible by the "
        f"size {axis_size} of axis {axis_name!r}{hint}")


def check_tokens(op: str, name: str, shape, axis_name: str, shards: int) -> None:
  """The first dimension holds the tokens and must split over `shards`."""
  hint = ""
  if len(shape) > 2:
    hint = (f". The first dimension is the tokens: for [batch, seq, features] "
            f"activations put the tokens first, e.g. x.reshape(-1, {shape[-1]}) "
            f"(or swap batch and sequence)")
  check_divisible(op, name, "tokens (first dimension)", shape[0], axis_name, shards, hint)


def check_activations(op: str, name: str, value) -> None:
  """Activations are ``[tokens, ..., features]``, no dimension empty.

  >>> check_activations("f", "x", np.ones((0, 3)))
  Traceback (most recent call last):
  ...
  ValueError: f: `x` has shape (0, 3), with a dimension of size 0; every dimension must be at least 1
  """
  if np.ndim(value) < 2:
    raise ValueError(
        f"{op}: `{name}` must have at least 2 dimensions [tokens, ..., "
        f"features], got shape {np.shape(value)}")
  check_not_empty(op, name, value)


def check_bias(names: Names, bias, features: int, x=None) -> None:
  """`bias` is None, or ``[features]`` of `x`'s dtype: a wider bias would
  silently widen the layer's output.

  >>> check_bias(Names("f"), np.ones(4, np.float32), 4, np.ones((2, 3), np.float16))
  Traceback (most recent call last):
  ...
  TypeError: f: `bias` has dtype float32 but `x` has float16; cast the bias (bias.astype(x.dtype))
  """
  if bias is None:
    return
  if np.shape(bias) != (features,):
    raise ValueError(
        f"{names.op}: `{names.bias}` must have shape ({features},) to match the kernel's "
        f"output features, got {np.shape(bias)}")
  if x is not None and jnp.result_type(bias) != jnp.result_type(x):
    raise TypeError(
        f"{names.op}: `{names.bias}` has dtype {jnp.result_type(bias)} but `{names.x}` has "
        f"{jnp.result_type(x)}; cast the bias ({names.bias}.astype({names.x}.dtype))")


def check_type(where: str, name: str, value, cls) -> None:
  """Raises TypeError naming `name` unless `value` is a `cls`.

  >>> check_type("f", "options", {}, Names)
  Traceback (most recent call last):
  ...
  TypeError: f: `options` must be a Names, got {} (dict)
  """
  if not isinstance(value, cls):
    raise TypeError(f"{where}: `{name}` must be a {cls.__name__}, got {value!r} "
                    f"({type(value).__name__})")


def check_fp8_histories(where: str, config, fp8_histories, layers: tuple[str, ...],
                        how: str):
  """`fp8_histories`: a dict of an AmaxHistory for each of `layers` where the
  config's FP8 recipe is "delayed" (`how` says where to get one), else None."""
  fp8 = getattr(config, "fp8", None)
  delayed = fp8 is not None and fp8.scaling == "delayed"
  if fp8_histories is None and not delayed:
    return None
  if not delayed:
    raise ValueError(f"{where}: `fp8_histories` is for CommGemmConfig(fp8=Fp8Recipe("
                     f"'delayed')); this config's fp8 is {fp8!r}")
  if not isinstance(fp8_histories, dict) or set(fp8_histories) != set(layers):
    raise ValueError(f"{where}: FP8 'delayed' scaling needs `fp8_histories`, a dict of an "
                     f"AmaxHistory for each of {layers} ({how}), got "
                     f"{type(fp8_histories).__name__}")
  return fp8_histories


def check_op_options(where: str, config, fp8_history, precision):
  """The options a collective matmul routes by, checked: `precision` (returned;
  only the default with FP8, whose GEMMs it would not reach), and an FP8 amax
  history only where the recipe is "delayed".

  >>> from jax_comm_gemm.config import CommGemmConfig
  >>> check_op_options("f", CommGemmConfig(), None, "highest")
  'highest'
  """
  precision = check_precision(where, precision)
  fp8 = getattr(config, "fp8", None)
  if fp8_history is not None and (fp8 is None or fp8.scaling != "delayed"):
    raise ValueError(f"{where}: `fp8_history` is for CommGemmConfig(fp8=Fp8Recipe('delayed')); "
                     f"this config's fp8 is {fp8!r}")
  if fp8 is not None:
    check_precision_used(where, precision, "config.fp8's GEMMs are FP8, accumulated as its "
                                           "Fp8Recipe.accumulation says")
  return precision


def check_flag(where: str, name: str, value) -> bool:
  """`value` as a Python bool where it is a bool or a numpy bool, else a
  TypeError naming the argument (a truthy ``"no"`` must not switch it on).

  >>> check_flag("f", "keep_gathered_input", np.True_)
  True
  >>> check_flag("f", "keep_gathered_input", "no")
  Traceback (most recent call last):
  ...
  TypeError: f: `keep_gathered_input` must be True or False, got 'no' (str)
  """
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(
      f"{where}: `{name}` must be True or False, got {value!r} "
      f"({type(value).__name__})")
