"""The FP8 collective matmuls' fused steps as rings of per-shard FP8 GEMMs and
``lax.ppermute`` (the collective-matmul pattern; bf16's in
:mod:`jax_comm_gemm.backends.xla`): the FP8 bytes of the next shard travel
while this shard's GEMM runs, and XLA schedules the two at once.

* :func:`all_gather_gemm`: ``AG(q8) . b8`` as P GEMMs, one per arriving
  shard; the gathered FP8 operand is assembled in place as the shards pass,
  for the weight gradient to reuse. With per-row scales each shard's scales
  travel in the same ppermute as its rows.
* :func:`gemm_reduce_scatter`: ``RS(a8 . b8)`` as P chunked GEMMs whose partial
  sums (in the output dtype, as XLA's reduce-scatter moves them) travel the ring.

``gemm(a8, scale_inv_a)`` is the layer's GEMM with its other operand bound
(:func:`jax_comm_gemm.fp8.steps.gemm`): the same FP8 GEMM per shard as on
XLA's collectives, so the result equals theirs up to the order of the sums.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
>>> gemm = lambda a8, ia: a8.astype(jnp.float32) * ia
>>> f = jax.shard_map(lambda q: all_gather_gemm(q, jnp.float32(2), gemm, "tp",
...                                             row_scales=False)[0],
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


def all_gather_gemm(q8, inv, gemm, axis_name: str, *, row_scales: bool):
  """``(y, g8, g_inv)``: y = ``gemm(AG(q8), AG(inv))`` computed shard by shard
  as the shards travel the ring, and the gathered operand (``g_inv`` is `inv`
  itself for one scale per tensor, agreed by every rank)."""
  size, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
  rows = q8.shape[0]
  from_previous = [(i, (i + 1) % size) for i in range(size)]
  shard = (q8, inv) if row_scales else (q8,)
  y = g8 = g_inv = None
  for step in range(size):
    following = lax.ppermute(shard, axis_name, from_previous) if step + 1 < size else None
    part = gemm(shard[0], shard[1] if row_scales else inv)
    start = ((rank - step) % size) * rows  # where the rank this shard came from belongs
    if y is None:
      y, g8 = _buffer(rows * size, part), _buffer(rows * size, q8)
      g_inv = _buffer(rows * size, inv) if row_scales else inv
    y = lax.dynamic_update_slice_in_dim(y, part, start, 0)
    g8 = lax.dynamic_update_slice_in_dim(g8, shard[0], start, 0)
    if row_scales:
      g_inv = lax.dynamic_update_slice_in_dim(g_inv, shard[1], start, 0)
    shard = following
  return y, g8, g_inv


def gemm_reduce_scatter(a8, inv, gemm, axis_name: str, *, row_scales: bool):
  """This rank's token chunk of ``sum over ranks of gemm(a8, inv)``: step s
  adds this rank's part of chunk ``(rank + 1 + s) % P`` to the partial sum
  that arrives from rank + 1."""
  size, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
  rows = a8.shape[0] // size

  def partial_sum(chunk):
    part = lax.dynamic_slice_in_dim(a8, chunk * rows, rows, 0)
    scales = lax.dynamic_slice_in_dim(inv, chunk * rows, rows, 0) if row_scales else inv
    return gemm(part, scales)

  acc = partial_sum((rank + 1) % size)
  to_previous = [(i, (i - 1) % size) for i in range(size)]
  for step in range(1, size):
    acc = lax.ppermute(acc, axis_name, to_previous) + partial_sum((rank + 1 + step) % size)
  return acc
