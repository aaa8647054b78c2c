"""Which path a layer takes, and how many all-gathers a training step should hold.

For reports (``examples/train_sp_mlp.py``) and tests: what the design promises,
to set beside what :func:`jax_comm_gemm.hlo.compiled_collectives` counts in a
compiled program.
"""

from __future__ import annotations

import dataclasses

from jax_comm_gemm.backends import CublasMpBackend, resolve_backend
from jax_comm_gemm.config import CommGemmConfig

FUSED_WITH_REUSE = "fused with reuse"
FUSED_WITH_ALL_GATHER = "fused with all_gather"
XLA_FALLBACK = "xla fallback"


def _reuses(config: CommGemmConfig, backend, axis_size: int, dtype) -> bool:
  return (config.reuse_gathered is not False
          and backend.gathered_reuse(axis_size, dtype).ok)


def layer_path(config: CommGemmConfig, axis_size: int, dtype, *,
               reduce_scatter_layer: bool = False,
               keep_gathered_input: bool = False) -> str:
  """How a layer's AllGather+GEMM runs and where its weight gradient gets the
  gathered operand from.

  A row-parallel layer (``reduce_scatter_layer=True``) gathers grad_output in
  its backward AllGather+GEMM and can reuse it for the weight gradient; a
  column-parallel layer can reuse its forward's gathered input only with
  ``keep_gathered_input``, and otherwise gathers it again.

  Returns:
    ``"fused with reuse"`` (cuBLASMp, the gathered operand handed out by the
    fused op), ``"fused with all_gather"`` (cuBLASMp, plus a ``lax.all_gather``
    for the weight gradient) or ``"xla fallback"`` (``lax.all_gather`` + dot;
    also cuBLASMp on an axis of size 1, where nothing is communicated).
  """
  backend = resolve_backend(config)
  if not isinstance(backend, CublasMpBackend) or axis_size == 1:
    return XLA_FALLBACK
  can_reuse = reduce_scatter_layer or keep_gathered_input
  if can_reuse and _reuses(config, backend, axis_size, dtype):
    return FUSED_WITH_REUSE
  return FUSED_WITH_ALL_GATHER


@dataclasses.dataclass(frozen=True)
class ExpectedCounts:
  """Collectives in one forward + backward of a sequence-parallel MLP block.

  ``standalone_all_gathers`` are ``all-gather`` ops in the compiled program;
  ``fused_all_gather_matmuls`` are cuBLASMp AllGather+GEMM custom calls.
  """
  standalone_all_gathers: int
  fused_all_gather_matmuls: int


def expected_all_gathers(config: CommGemmConfig, axis_size: int, dtype, *,
                         keep_gathered_input: bool = False) -> ExpectedCounts:
  """The all-gathers of one SP-MLP block's forward + backward (a training step).

  With cuBLASMp, two AllGather+GEMMs run fused (fc1's forward, fc2's dgrad),
  and the weight gradients add a standalone ``lax.all_gather`` each unless the
  operand is reused: 2 standalone without reuse, 1 with reuse (fc2's), 0 when
  fc1 also keeps its forward's gathered input (the design's table: "MLP 2 -> 1
  with reuse, 0 with keep_gathered_input").

  With the XLA fallback every gather is an ``all-gather`` op: fc1's forward
  gather and fc2's dgrad gather, 2 in all. fc1's backward gathers its input
  again, but that op is the forward's one on the same operand, and XLA's CSE
  merges the two, so it does not show (as with plain autodiff, which the
  design notes saw keep 2 all-gathers per block). On an axis of size 1 every
  backend takes this path (XLA keeps the trivial all-gathers, at least on CPU).
  """
  backend = resolve_backend(config)
  if not isinstance(backend, CublasMpBackend) or axis_size == 1:
    return ExpectedCounts(2, 0)
  reuse = _reuses(config, backend, axis_size, dtype)
  # fc1: keep without reuse gathers in the forward instead of the backward.
  fc1 = 0 if keep_gathered_input and reuse else 1
  fc2 = 0 if reuse else 1
  return ExpectedCounts(fc1 + fc2, 2)
