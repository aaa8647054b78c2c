"""What an FP8 layer quantizes with: :class:`Fp8Recipe`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

SCALINGS = ("tensor", "row", "delayed", "block")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
GEMM_FORMS = ("direct", "cublaslt")
ACCUMULATIONS = ("fast", "fast_forward", "precise")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How the FP8 collective matmuls quantize: current scaling, E4M3 forward,
  E5M2 gradients.

  Only the GEMM operands are FP8, made by a cast at each call; the master
  weights stay in the caller's float32/bfloat16, and every output and gradient
  comes back in its primal's dtype.

  Fields:
    scaling: ``"tensor"``: one scale per tensor. The amax of the local shard is
      reduced with ``lax.pmax`` over the tensor-parallel axis, so every rank
      quantizes with ONE scale and the gathered bytes are those of the whole
      tensor quantized at once. ``"row"``: one scale per token row of the
      activation (and of the gradient), one per output column of each weight
      copy (per row of the GEMM's TN operand, cuBLASMp's ``OUTER_VEC_FP32``);
      these scales are local to the rank that holds the row, and they travel
      in the same ``lax.all_gather`` call as the FP8 rows. ``"delayed"``: one
      scale per tensor as ``"tensor"``, but from the largest amax of the last
      `amax_history` steps (kept by the caller: :class:`AmaxHistory`), so the
      cast does not wait for this step's amax; this step's agreed amax enters
      the history. An empty history (all zeros: the first step) scales with
      this step's amax.
    forward_dtype: the FP8 type of the forward operands (activations and
      weights); default ``float8_e4m3fn`` (max 448, 3 mantissa bits).
    backward_dtype: the FP8 type of the output gradient; default
      ``float8_e5m2`` (max 57344, 2 mantissa bits). The weight-gradient GEMM
      takes the forward's activation in ``forward_dtype``.
    margin: an int >= 0: ``scale = fp8_max / amax / 2**margin``, headroom
      against values growing between the amax and the cast (0: none).
    gemm_form: how a per-tensor-scaled GEMM is written for XLA
      (:func:`jax_comm_gemm.fp8.gemm.fp8_gemm_tn`): ``"direct"`` (FP8
      operands, the scales' product applied to the output; the default) or
      ``"cublaslt"`` (the
      project's FP8 GEMM custom call: cuBLASLt applies the scales, and its
      algorithm is timed at the first call; "direct" where it cannot run).
    amax_history: ``"delayed"`` only: how many steps' amaxes a history keeps
      (an int >= 1).
    accumulation: Hopper's FP8 fast accumulation (partial sums along k kept in
      the tensor core's reduced precision instead of promoted to f32), for
      ``"fast"`` every GEMM (XLA's default for an FP8 dot), ``"fast_forward"``
      the forward GEMM only, the two gradient GEMMs promoted (the split
      TransformerEngine makes: their sums run over more terms and E5M2 values),
      ``"precise"`` none.

  Saturation: a value beyond the FP8 range after scaling (possible only with a
  scale not computed from this tensor's amax, or when rounding lands above)
  is clipped to +-max; E4M3 has no infinity, and a plain cast would make NaN.

  NaN and inf: the amax of a tensor that holds a NaN is NaN, of one that holds
  an inf is inf, and its scale is then NaN or 0; every value that scale
  dequantizes is NaN. So an output that bf16 makes non-finite is NaN in FP8
  too: with ``"row"`` exactly the outputs bf16 spoils (the tokens' rows, or
  the weight column's outputs), except the column-parallel weight gradient,
  whose operand is requantized per column from row-scaled data: all NaN; with
  ``"tensor"`` every output that the tensor's scale touches (the whole GEMM
  output, and through ``pmax`` the other ranks' too). Nothing is clipped away.

  >>> Fp8Recipe.from_key(Fp8Recipe(margin=1).key) == Fp8Recipe(margin=1)
  True
  >>> Fp8Recipe("delayed", amax_history=4).key
  'fp8 delayed/4 float8_e4m3fn/float8_e5m2 margin=0 direct fast'
  >>> Fp8Recipe.from_key(Fp8Recipe("delayed", amax_history=4).key).amax_history
  4
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
    return (f"fp8 {scaling} {self.forward_dtype.name}/{self.backward_dtype.name} "
            f"margin={self.margin} {self.gemm_form} {self.accumulation}")

  @classmethod
  def from_key(cls, key: str) -> "Fp8Recipe":
    """The recipe whose :attr:`key` is `key`."""
    try:
      tag, scaling, dtypes, margin, form, accumulation = key.split(" ")
      forward, backward = dtypes.split("/")
      if tag != "fp8" or not margin.startswith("margin="):
        raise ValueError
      scaling, _, history = scaling.partition("/")
      return cls(scaling, jnp.dtype(forward), jnp.dtype(backward),
                 int(margin.removeprefix("margin=")), form, accumulation,
                 int(history) if history else 16)
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

