"""XLA's own collectives and dot: the fallback everywhere, the reference for
speed, and the GEMM helpers the other backends and the weight gradients share."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import jax.numpy as jnp
from jax import lax

from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.runtime.capability import Capability
from jax_comm_gemm.vma import pvary, varying_axes


def local_matmul(x, w, transpose_w: bool, precision=None):
  """x @ w, or x @ w.T when `transpose_w`, in the input dtype.

  >>> import jax.numpy as jnp
  >>> local_matmul(jnp.ones((4, 3)), jnp.ones((2, 3)), transpose_w=True).shape
  (4, 2)
  """
  contract = 1 if transpose_w else 0
  return lax.dot_general(x, w, (((1,), (contract,)), ((), ())), precision=precision)


def gathered_matmul_t(g, dy, precision=None):
  """g.T @ dy, contracting the token rows of both.

  >>> import jax.numpy as jnp
  >>> gathered_matmul_t(jnp.ones((4, 3)), jnp.ones((4, 2))).tolist()[0]
  [4.0, 4.0]
  """
  return lax.dot_general(g, dy, (((0,), (0,)), ((), ())), precision=precision)


def weight_gradient(inputs, grads, transpose_w: bool, precision=None):
  """The gradient of w in ``y = inputs @ w`` (w [k, m]) or ``inputs @ w.T``
  (w [m, k], `transpose_w`), from the layer's inputs [n, k] and the gradient
  of its output [n, m], all n token rows present: ``inputs.T @ grads``, or
  ``grads.T @ inputs``. The one home of this rule: every backward pass and
  the fused weight gradient's XLA lowering call it.

  >>> import jax.numpy as jnp
  >>> weight_gradient(jnp.ones((4, 2)), jnp.ones((4, 3)), transpose_w=False).shape
  (2, 3)
  """
  if transpose_w:
    return gathered_matmul_t(grads, inputs, precision)
  return gathered_matmul_t(inputs, grads, precision)


def all_gather_tokens(x, axis_name: str):
  """Every shard's token rows, in rank order (inside shard_map).

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> jax.shard_map(lambda x: all_gather_tokens(x, "tp"), mesh=mesh, in_specs=P("tp"),
  ...               out_specs=P("tp"))(jnp.ones((4, 2))).shape
  (4, 2)
  """
  return lax.all_gather(x, axis_name, axis=0, tiled=True)


def ring_all_gather_matmul(x, w, axis_name: str, transpose_w: bool, return_gathered: bool,
                           precision=None):
  """AllGather(x) @ w as P GEMMs, one per shard, while the shards travel a
  ring by ppermute: the transfer of the next shard does not depend on the GEMM
  of this one, so XLA runs the two at once. The output rows (and the gathered
  operand, if asked for) are written in place where each shard belongs.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: ring_all_gather_matmul(x, w, "tp", False, False),
  ...                   mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).tolist()[0]
  [3.0, 3.0]
  """
  size = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  rows = x.shape[0]
  from_previous = [(i, (i + 1) % size) for i in range(size)]
  y = g = None
  shard = x
  for step in range(size):
    following = lax.ppermute(shard, axis_name, from_previous) if step + 1 < size else None
    part = local_matmul(shard, w, transpose_w, precision)
    start = ((rank - step) % size) * rows  # the rank this shard came from
    if y is None:  # buffers varying like the parts written into them
      y = pvary(jnp.zeros((rows * size, part.shape[1]), part.dtype), varying_axes(part))
      if return_gathered:
        g = pvary(jnp.zeros((rows * size, x.shape[1]), x.dtype), varying_axes(shard))
    y = lax.dynamic_update_slice_in_dim(y, part, start, 0)
    if return_gathered:
      g = lax.dynamic_update_slice_in_dim(g, shard, start, 0)
    shard = following
  return (y, g) if return_gathered else y


def ring_matmul_reduce_scatter(x, w, axis_name: str, transpose_w: bool, precision=None):
  """RS(x @ w) as P chunked GEMMs whose partial sums travel a ring by ppermute,
  so that XLA overlaps each transfer with the next GEMM (the collective-matmul
  pattern of JAX's shard_map documentation).

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: ring_matmul_reduce_scatter(x, w, "tp", False),
  ...                   mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).tolist()[0]
  [3.0, 3.0]
  """
  size = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  rows = x.shape[0] // size

  def partial_sum(chunk):
    return local_matmul(lax.dynamic_slice_in_dim(x, chunk * rows, rows, 0), w, transpose_w,
                        precision)

  # Step s adds this shard's part of chunk (rank + 1 + s) % P to the sum that
  # arrives from rank + 1; after P - 1 steps each rank holds its own chunk.
  acc = partial_sum((rank + 1) % size)
  to_previous = [(i, (i - 1) % size) for i in range(size)]
  for step in range(1, size):
    acc = lax.ppermute(acc, axis_name, to_previous) + partial_sum((rank + 1 + step) % size)
  return acc


@dataclasses.dataclass(frozen=True)
class XlaBackend(Backend):
  """``lax.all_gather`` + dot and dot + ``lax.psum_scatter``.

  >>> XlaBackend().gathered_reuse(2, "bfloat16", False).ok
  True
  """

  name = "xla"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    g = all_gather_tokens(x, axis_name)
    y = local_matmul(g, w, transpose_w, precision)
    return (y, g) if return_gathered else y

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    return lax.psum_scatter(local_matmul(x, w, transpose_w, precision), axis_name,
                            scatter_dimension=0, tiled=True)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    return Capability(True, "XLA's all_gather result is an ordinary array")


@dataclasses.dataclass(frozen=True)
class RingBackend(XlaBackend):
  """Both ops as rings of per-shard GEMMs and ``lax.ppermute`` (the
  collective-matmul pattern): overlap that XLA schedules, on any platform.

  >>> RingBackend().gathered_reuse(2, "bfloat16", False).reason
  'the ring assembles the gathered operand as an ordinary array'
  """

  name = "ring"

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    return ring_all_gather_matmul(x, w, axis_name, transpose_w, return_gathered, precision)

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    return ring_matmul_reduce_scatter(x, w, axis_name, transpose_w, precision)

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    return Capability(True, "the ring assembles the gathered operand as an ordinary array")


# The backends that need neither cuBLASMp nor a connected axis, by name.
PLAIN_BACKENDS = MappingProxyType({"xla": XlaBackend, "ring": RingBackend})
