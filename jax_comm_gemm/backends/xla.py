"""XLA's own collectives and dot: the fallback everywhere, the reference for
speed, and the GEMM helpers the other backends and the weight gradients share."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from jax import lax

import jax_comm_gemm.ring as ring
from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.runtime.capability import Capability


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
  ``grads.T @ inputs``. The one home of this rule: every backward pass
  calls it.

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
  """AllGather(x) @ w on the ring (jax_comm_gemm/ring.py): a GEMM per shard
  while the next one travels; the gathered operand assembled as they pass.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: ring_all_gather_matmul(x, w, "tp", False, False),
  ...                   mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).tolist()[0]
  [3.0, 3.0]
  """
  y, g, _ = ring.all_gather_gemm(
      x, None, lambda shard, _: local_matmul(shard, w, transpose_w, precision), axis_name)
  return (y, g) if return_gathered else y


def ring_matmul_reduce_scatter(x, w, axis_name: str, transpose_w: bool, precision=None):
  """RS(x @ w) on the ring (jax_comm_gemm/ring.py): chunked GEMMs whose partial
  sums travel while the next chunk's GEMM runs.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, w: ring_matmul_reduce_scatter(x, w, "tp", False),
  ...                   mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp"))
  >>> f(jnp.ones((4, 3)), jnp.ones((3, 2))).tolist()[0]
  [3.0, 3.0]
  """
  return ring.gemm_reduce_scatter(
      x, None, lambda chunk, _: local_matmul(chunk, w, transpose_w, precision), axis_name)


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
