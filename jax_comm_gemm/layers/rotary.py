"""Rotary position embeddings (RoPE) in the half-split convention of Hugging
Face's Llama (``rotate_half``): a head's feature i pairs with feature
i + head_dim/2, rotated by ``position * base**(-2i/head_dim)``. Meta's original
checkpoints pair features (2i, 2i+1); Hugging Face's conversion permutes the
query and key projections' columns so that this convention applies."""

from __future__ import annotations

import jax.numpy as jnp


def check_head_dim(op: str, head_dim: int) -> None:
  """Rotary embeddings rotate feature pairs: `head_dim` must be even.

  >>> check_head_dim("f", 5)
  Traceback (most recent call last):
  ...
  ValueError: f: rotary embeddings rotate pairs of features, so head_dim must be even, got head_dim=5
  """
  if head_dim % 2:
    raise ValueError(f"{op}: rotary embeddings rotate pairs of features, so head_dim must "
                     f"be even, got head_dim={head_dim}")


def apply_rotary(x, positions, base: float):
  """x ``[batch, seq, heads, head_dim]`` rotated at `positions` ``[seq]`` (the
  global position of each row); computed in float32 at least, returned in x's
  dtype.

  >>> apply_rotary(jnp.ones((1, 2, 1, 4)), jnp.arange(2), 10000.0)[0, 0, 0].tolist()
  [1.0, 1.0, 1.0, 1.0]
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  half = x.shape[-1] // 2
  inverse = jnp.asarray(base, dtype) ** (-jnp.arange(half, dtype=dtype) * 2 / x.shape[-1])
  angles = jnp.asarray(positions, dtype)[:, None] * inverse[None, :]  # [seq, half]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  xf = x.astype(dtype)
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
