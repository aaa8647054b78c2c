"""The NNX home of FP8 "delayed" scaling state: :class:`OverwriteWithGradient`,
the Variable type of the amax histories, and :func:`overwrite_with_gradient`,
the update. A history's gradient is its next value, to replace it with, not to
apply (:class:`jax_comm_gemm.fp8.AmaxHistory`), as Flax linen's
``_overwrite_with_gradient`` collection. :data:`OverwriteWithGradient` is the
type flax's registry holds under that name (``nnx.bridge`` and trainers filter
on it), else this module's class, registered here. A train step::

  diff = nnx.DiffState(0, (nnx.Param, OverwriteWithGradient))

  @nnx.jit
  def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, x)
    optimizer.update(model, overwrite_with_gradient(model, grads))
    return loss

A history serves one call per step; micro-batches combine them with
``jnp.maximum``, not a sum."""

from __future__ import annotations

from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT


class OverwriteWithGradient(nnx.Variable):
  """State that a train step replaces with its gradient (Flax linen's
  ``_overwrite_with_gradient`` collection), such as an FP8 amax history.

  >>> import jax.numpy as jnp
  >>> OverwriteWithGradient(jnp.zeros(3))[...].tolist()
  [0.0, 0.0, 0.0]
  """


def _registered(own: type[nnx.Variable]) -> type[nnx.Variable]:
  """The Variable type flax's registry holds for the linen collection; `own`,
  registered, where it holds none."""
  try:
    return nnx.variable_type_from_name(OVERWRITE_WITH_GRADIENT)
  except ValueError:  # nobody registered the name yet
    return nnx.register_variable_name(OVERWRITE_WITH_GRADIENT, own)


# The registry's type, where another (nnx.bridge, a trainer, a later flax) came first.
OverwriteWithGradient = _registered(OverwriteWithGradient)


def overwrite_with_gradient(model: nnx.Module, grads: nnx.State) -> nnx.State:
  """Replaces every :data:`OverwriteWithGradient` variable of `model` with its
  entry of `grads` and returns the other gradients, for the optimizer. A
  ``ValueError`` names the variables `grads` lacks (differentiate with
  ``argnums=nnx.DiffState(0, (nnx.Param, OverwriteWithGradient))``).

  >>> import jax.numpy as jnp
  >>> class M(nnx.Module):
  ...   def __init__(self):
  ...     self.w = nnx.Param(jnp.ones(2))
  ...     self.h = OverwriteWithGradient(jnp.zeros(2))
  >>> m = M()
  >>> grads = nnx.State({"w": nnx.Param(jnp.ones(2)), "h": OverwriteWithGradient(jnp.ones(2))})
  >>> sorted(nnx.to_pure_dict(overwrite_with_gradient(m, grads))), m.h[...].tolist()
  (['w'], [1.0, 1.0])
  """
  histories = nnx.state(grads, OverwriteWithGradient)
  held = {path for path, _ in nnx.to_flat_state(nnx.state(model, OverwriteWithGradient))}
  missing = held - {path for path, _ in nnx.to_flat_state(histories)}
  if missing:
    names = ", ".join(sorted(".".join(map(str, path)) for path in missing))
    raise ValueError(
        f"overwrite_with_gradient: `grads` has no gradient for {names}: differentiate "
        "with respect to them too, argnums=nnx.DiffState(0, (nnx.Param, "
        "OverwriteWithGradient))")
  nnx.update(model, histories)
  return nnx.state(grads, nnx.Not(OverwriteWithGradient))
