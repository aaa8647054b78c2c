"""What an FP8 layer quantizes with: :class:`Fp8Recipe`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_comm_gemm import validation
import jax_comm_gemm.fp8.quantize as qz

SCALINGS = ("tensor", "row", "delayed", "block")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
GEMM_FORMS = ("direct", "cublaslt")
ACCUMULATIONS = ("fast", "fast_forward", "precise")
CASTS = ("fused", "xla")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How the FP8 collective matmuls quantize: current scaling, E4M3 forward,
  E5M2 gradients. Only the GEMM operands are FP8, cast at each call; master
  weights, outputs and gradients stay in the caller's dtypes.

  Fields (docs/fp8.md#recipes-fp8recipe says more, and how saturation, NaN
  and inf come out):
    scaling: ``"tensor"`` (one scale per tensor, its amax agreed over the
      tensor-parallel axis), ``"row"`` (per token row; per output column of a
      weight copy), ``"delayed"`` (per tensor, from an :class:`AmaxHistory` of
      the last `amax_history` steps) or ``"block"`` (1x128 / 128x128 blocks).
    forward_dtype: the forward operands' FP8 type (``float8_e4m3fn``).
    backward_dtype: the output gradient's FP8 type (``float8_e5m2``).
    margin: an int >= 0: ``scale = fp8_max / amax / 2**margin``.
    gemm_form: ``"direct"`` (FP8 dot, the scales on the output) or
      ``"cublaslt"`` (the project's FP8 GEMM custom call).
    accumulation: Hopper's fast accumulation in every GEMM (``"fast"``), in
      the forward GEMM only (``"fast_forward"``) or in none (``"precise"``).
    amax_history: ``"delayed"`` only: how many steps' amaxes a history keeps.
    casts: how a per-tensor operand's row-major and transposed FP8 copies are
      made: ``"fused"`` (one pass of :mod:`jax_comm_gemm.fp8.cast`'s kernel on
      a GPU, where its tiles divide the operand) or ``"xla"`` (XLA's passes).
      The bytes are the same.

  >>> Fp8Recipe.from_key(Fp8Recipe(margin=1).key) == Fp8Recipe(margin=1)
  True
  >>> Fp8Recipe("delayed", amax_history=4).key
  'fp8 delayed/4 float8_e4m3fn/float8_e5m2 margin=0 direct fast'
  >>> Fp8Recipe.from_key(Fp8Recipe("delayed", amax_history=4).key).amax_history
  4
  >>> Fp8Recipe(casts="xla").key
  'fp8 tensor float8_e4m3fn/float8_e5m2 margin=0 direct fast casts=xla'
  >>> Fp8Recipe.from_key(Fp8Recipe(casts="xla").key).casts
  'xla'
  >>> Fp8Recipe(scaling="column")
  Traceback (most recent call last):
  ...
  ValueError: Fp8Recipe.scaling must be one of ('tensor', 'row', 'delayed', 'block'), got 'column'
  """

  scaling: str = "tensor"
  forward_dtype: Any = jnp.float8_e4m3fn
  backward_dtype: Any = jnp.float8_e5m2
  margin: int = 0
  gemm_form: str = "direct"
  accumulation: str = "fast"
  amax_history: int = 16
  casts: str = "fused"

  def __post_init__(self):
    if self.scaling not in SCALINGS:
      raise ValueError(f"Fp8Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
    for name in ("forward_dtype", "backward_dtype"):
      value = getattr(self, name)
      try:
        dtype = jnp.dtype(value)
      except TypeError:
        dtype = None
      if dtype not in FP8_DTYPES:
        raise ValueError(f"Fp8Recipe.{name} must be float8_e4m3fn or float8_e5m2, "
                         f"got {value!r}")
      object.__setattr__(self, name, dtype)
    if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
      raise ValueError(f"Fp8Recipe.margin must be an int >= 0, got {self.margin!r}")
    if (isinstance(self.amax_history, bool) or not isinstance(self.amax_history, int)
        or self.amax_history < 1):
      raise ValueError(f"Fp8Recipe.amax_history must be an int >= 1, got {self.amax_history!r}")
    if self.accumulation not in ACCUMULATIONS:
      raise ValueError(f"Fp8Recipe.accumulation must be one of {ACCUMULATIONS}, "
                       f"got {self.accumulation!r}")
    if self.casts not in CASTS:
      raise ValueError(f"Fp8Recipe.casts must be one of {CASTS}, got {self.casts!r}")
    if self.gemm_form not in GEMM_FORMS:
      raise ValueError(f"Fp8Recipe.gemm_form must be one of {GEMM_FORMS}, "
                       f"got {self.gemm_form!r}")

  @property
  def per_tensor(self) -> bool:
    """One scale per tensor, agreed by every rank ("tensor", "delayed")."""
    return self.scaling not in ("row", "block")

  @property
  def key(self) -> str:
    """The recipe as text, for autotune's problem keys (its disk cache too).

    >>> Fp8Recipe().key
    'fp8 tensor float8_e4m3fn/float8_e5m2 margin=0 direct fast'
    """
    scaling = (f"delayed/{self.amax_history}" if self.scaling == "delayed"
               else self.scaling)
    # The casts change no byte, but autotune times them: named unless "fused".
    casts = "" if self.casts == "fused" else f" casts={self.casts}"
    return (f"fp8 {scaling} {self.forward_dtype.name}/{self.backward_dtype.name} "
            f"margin={self.margin} {self.gemm_form} {self.accumulation}{casts}")

  @classmethod
  def from_key(cls, key: str) -> "Fp8Recipe":
    """The recipe whose :attr:`key` is `key`."""
    try:
      tag, scaling, dtypes, margin, form, accumulation, *casts = key.split(" ")
      if len(casts) > 1 or casts and not casts[0].startswith("casts="):
        raise ValueError
      forward, backward = dtypes.split("/")
      if tag != "fp8" or not margin.startswith("margin="):
        raise ValueError
      scaling, _, history = scaling.partition("/")
      return cls(scaling, jnp.dtype(forward), jnp.dtype(backward),
                 int(margin.removeprefix("margin=")), form, accumulation,
                 int(history) if history else 16,
                 casts[0].removeprefix("casts=") if casts else "fused")
    except (ValueError, TypeError):
      raise ValueError(f"not an Fp8Recipe key: {key!r}") from None


class AmaxHistory(NamedTuple):
  """The amaxes of the last steps that a ``"delayed"`` op scales with, newest
  first, one float32 vector of ``recipe.amax_history`` each: of the input
  (`x`), of the weight (`w`) and of the output gradient (`dy`).

  An op takes it as an input and hands the updated history out as its
  gradient ("overwrite with gradient", as Flax's FP8 ops and
  ``flax.training.train_state.TrainState`` do): ``jax.grad`` with respect to
  it gives the next step's history, to replace it with, not to apply. So a
  history serves one op call per step.

  >>> AmaxHistory.zeros(Fp8Recipe("delayed", amax_history=4)).x.tolist()
  [0.0, 0.0, 0.0, 0.0]
  """
  x: Any
  w: Any
  dy: Any

  @classmethod
  def zeros(cls, recipe: Fp8Recipe) -> "AmaxHistory":
    """An empty history (the first step scales with its own amaxes)."""
    z = jnp.zeros((recipe.amax_history,), jnp.float32)
    return cls(z, z, z)


def scaling_amax(history, current):
  """The amax a delayed scale comes from: the history's largest, or `current`
  while the history is empty (all zeros).

  >>> float(scaling_amax(jnp.array([0.0, 3.0]), jnp.float32(5.0)))
  3.0
  """
  largest = jnp.max(history)
  return jnp.where(largest > 0, largest, current)


def pushed(history, current):
  """`history` with `current` in front and the oldest entry dropped.

  >>> pushed(jnp.array([1.0, 2.0, 3.0]), jnp.float32(9.0)).tolist()
  [9.0, 1.0, 2.0]
  """
  return jnp.concatenate([jnp.reshape(current, (1,)).astype(jnp.float32), history[:-1]])


def checked_history(op, recipe, history):
  """`history`, checked against the recipe: a "delayed" one needs it (one
  float32 vector of ``recipe.amax_history`` per tensor), the others take none."""
  if recipe.scaling != "delayed":
    if history is not None:
      raise ValueError(f"{op}: `history` is for a 'delayed' recipe; this one scales "
                       f"{recipe.scaling!r}")
    return None
  if not isinstance(history, AmaxHistory):
    raise ValueError(f"{op}: a 'delayed' recipe needs `history`, an AmaxHistory "
                     f"(AmaxHistory.zeros(recipe) to start), got {type(history).__name__}")
  for name, h in zip(AmaxHistory._fields, history):
    if jnp.shape(h) != (recipe.amax_history,):
      raise ValueError(f"{op}: `history.{name}` must have shape ({recipe.amax_history},) "
                       f"(recipe.amax_history), got {jnp.shape(h)}")
  return AmaxHistory(*(jnp.asarray(h, jnp.float32) for h in history))


OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_operands(op, x, w, transpose_w, recipe, tokens):
  """An FP8 op's recipe, x and w, checked (`tokens`: all ranks')."""
  if not isinstance(recipe, Fp8Recipe):
    raise TypeError(f"{op}: `recipe` must be an Fp8Recipe, got {type(recipe).__name__}")
  if np.ndim(x) < 2 or np.ndim(w) != 2:
    raise ValueError(f"{op}: x must be [tokens, ..., k] and w 2-D, got shapes "
                     f"{np.shape(x)} and {np.shape(w)}")
  for name, a in (("x", x), ("w", w)):
    if jnp.dtype(a.dtype) not in OUT_DTYPES:
      raise ValueError(f"{op}: `{name}` must be bfloat16, float16 or float32 (the FP8 "
                       f"copies are made inside), got {a.dtype}")
  validation.check_inner(op, "`x`", x.shape[-1], f"`w` (transpose_w={transpose_w})",
                         w.shape[1] if transpose_w else w.shape[0], w.shape)
  if recipe.scaling == "block" and (tokens % qz.BLOCK or any(d % qz.BLOCK for d in w.shape)):
    raise ValueError(f"{op}: 'block' scaling quantizes in blocks of {qz.BLOCK}: w's dims "
                     f"and the tokens (all ranks') must be multiples of {qz.BLOCK}, got w "
                     f"{tuple(w.shape)} and {tokens} tokens")


def check_bias(op, name, bias, columns):
  """A bias added inside an FP8 op (None, or a float vector of the op's
  `columns` output features), checked: its dtype, that of its gradient."""
  if bias is not None and (jnp.shape(bias) != (columns,)
                           or jnp.dtype(bias.dtype) not in OUT_DTYPES):
    raise ValueError(f"{op}: `{name}` must be None or a float vector of w's {columns} "
                     f"output columns, got {jnp.shape(bias)} {getattr(bias, 'dtype', '')}")
  return None if bias is None else jnp.dtype(bias.dtype)
