"""The ring: a collective matmul as per-shard GEMMs and ``lax.ppermute`` (the
collective-matmul pattern of JAX's shard_map documentation), one for bf16
(``backends.xla.RingBackend``) and FP8 (``fp8.steps``): the next shard travels
while this shard's GEMM runs. ``gemm(x, scales)`` is the layer's GEMM with its
other operand bound; `scales` is None for bf16, one scale per tensor, or with
`row_scales` one per row of x (travelling with its rows).

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
>>> gemm = lambda x, s: x.astype(jnp.float32) * s
>>> f = jax.shard_map(lambda q: all_gather_gemm(q, jnp.float32(2), gemm, "tp")[0],
...                   mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
>>> f(jnp.ones((2, 3), jnp.float8_e4m3fn)).tolist()
[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_comm_gemm.vma import pvary, varying_axes


def _buffer(rows, like):
  """A zero buffer of `rows` rows shaped and varying like `like`'s rows."""
  return pvary(jnp.zeros((rows,) + like.shape[1:], like.dtype), varying_axes(like))


def all_gather_gemm(x, scales, gemm, axis_name: str, *, row_scales: bool = False):
  """``(y, g, g_scales)``: y = ``gemm(AG(x), AG(scales))`` computed shard by
  shard as the shards travel the ring, and the gathered operand (``g_scales``
  is `scales` itself unless `row_scales`). Written in place where each shard
  belongs (rank order)."""
  size, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
  rows = x.shape[0]
  from_previous = [(i, (i + 1) % size) for i in range(size)]
  shard = (x, scales) if row_scales else (x,)
  y = g = g_scales = None
  for step in range(size):
    following = lax.ppermute(shard, axis_name, from_previous) if step + 1 < size else None
    part = gemm(shard[0], shard[1] if row_scales else scales)
    start = ((rank - step) % size) * rows  # where the rank this shard came from belongs
    if y is None:
      y, g = _buffer(rows * size, part), _buffer(rows * size, x)
      g_scales = _buffer(rows * size, scales) if row_scales else scales
    y = lax.dynamic_update_slice_in_dim(y, part, start, 0)
    g = lax.dynamic_update_slice_in_dim(g, shard[0], start, 0)
    if row_scales:
      g_scales = lax.dynamic_update_slice_in_dim(g_scales, shard[1], start, 0)
    shard = following
  return y, g, g_scales


def gemm_reduce_scatter(x, scales, gemm, axis_name: str, *, row_scales: bool = False):
  """This rank's token chunk of ``sum over ranks of gemm(x, scales)``: step s
  adds this rank's part of chunk ``(rank + 1 + s) % P`` to the partial sum
  that arrives from rank + 1; after P - 1 steps each rank holds its own chunk."""
  size, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
  rows = x.shape[0] // size

  def partial_sum(chunk):
    part = lax.dynamic_slice_in_dim(x, chunk * rows, rows, 0)
    chunk_scales = (lax.dynamic_slice_in_dim(scales, chunk * rows, rows, 0) if row_scales
                    else scales)
    return gemm(part, chunk_scales)

  acc = partial_sum((rank + 1) % size)
  to_previous = [(i, (i - 1) % size) for i in range(size)]
  for step in range(1, size):
    acc = lax.ppermute(acc, axis_name, to_previous) + partial_sum((rank + 1 + step) % size)
  return acc
