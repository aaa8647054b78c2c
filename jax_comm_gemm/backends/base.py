"""What a backend is: how one AllGather+GEMM or GEMM+ReduceScatter runs on
local shards inside ``jax.shard_map``. Backends do what they are told; whether
to ask for the gathered operand is decided in ``routes.gathered_route`` alone."""

from __future__ import annotations

from jax_comm_gemm.runtime.capability import Capability


class Backend:
  """Interface of a backend. All arrays are per-shard, inside shard_map.

  all_gather_matmul: x [n/P, k], w [k, m] (or [m, k] with transpose_w)
    -> y [n, m] (and the gathered x [n, k] with return_gathered).
  matmul_reduce_scatter: x [n, k], w [k, m] (or [m, k]) -> y [n/P, m],
    summed over the axis.
  gathered_reuse: whether return_gathered hands out the operand the op
    gathered anyway, for this group size, dtype and transpose; only then may
    a caller ask for it.
  fp8_fused_ops: whether the backend has the extension's fused FP8 ops
    (``CublasMpBackend``'s ``fp8_all_gather_matmul``, ``fp8_matmul_reduce_scatter``).
  `precision` goes to the GEMMs that XLA runs. A backend is a frozen dataclass:
  a static argument of the custom_vjp rules, it must hash and compare by value.

  >>> import dataclasses
  >>> from jax_comm_gemm.backends.xla import XlaBackend
  >>> @dataclasses.dataclass(frozen=True)
  ... class Logged(XlaBackend):
  ...   name = "logged"
  >>> Logged() == Logged()
  True
  """

  name = "abstract"
  fp8_fused_ops = False

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    raise NotImplementedError

  def matmul_reduce_scatter(self, x, w, axis_name, *, transpose_w, precision=None):
    raise NotImplementedError

  def gathered_reuse(self, axis_size: int, dtype, transpose_w: bool) -> Capability:
    raise NotImplementedError

