"""Which path a layer takes and why, and how many all-gathers a training step
should hold.

For reports (the example) and tests: what the design promises, to set beside
what :func:`jax_comm_gemm.diagnostics.hlo.compiled_collectives` counts in a
compiled program. Both questions are answered by the functions that decide at
trace time (``backends.select.choose_backend`` and
``collective_matmul.gathered_route``): nothing is re-derived here.
"""

from __future__ import annotations

import dataclasses

from jax_comm_gemm.backends import AutoBackend, CublasMpBackend, choose_backend, pallas
from jax_comm_gemm.collective_matmul import gathered_route
from jax_comm_gemm.config import CommGemmConfig

FUSED_WITH_REUSE = "fused with reuse"
FUSED_WITH_ALL_GATHER = "fused with all_gather"
XLA_FALLBACK = "xla fallback"
PALLAS_KERNEL = "pallas kernel"


@dataclasses.dataclass(frozen=True)
class LayerPath:
  """How a layer runs (one of the four names above) and why."""
  path: str
  reason: str

  def __str__(self) -> str:
    return f"{self.path} ({self.reason})"


def layer_path(config: CommGemmConfig, mesh, axis_name: str, dtype, *,
               reduce_scatter_layer: bool = False,
               keep_gathered_input: bool = False) -> LayerPath:
  """How a layer's AllGather+GEMM runs on `axis_name` of `mesh`, and where its
  weight gradient gets the gathered operand from.

  A row-parallel layer (``reduce_scatter_layer=True``) gathers grad_output in
  its backward AllGather+GEMM (with the transposed kernel) and can reuse it; a
  column-parallel layer can reuse its forward's gathered input only with
  ``keep_gathered_input``, and otherwise gathers it again.
  """
  choice = choose_backend(config, axis_name, mesh)
  size = int(mesh.shape[axis_name])
  if isinstance(choice.backend, pallas.PallasBackend):
    # Its weight gradients gather again (the kernel hands out no gathered
    # operand), as XLA's do: the counts are the fallback's either way.
    verdict = pallas.supports_layer(dtype, reduce_scatter_layer,
                                    keep_gathered_input or reduce_scatter_layer, size)
    if verdict.ok:
      return LayerPath(PALLAS_KERNEL, "jax's Mosaic GPU kernel runs the AllGather+GEMM "
                                      "where its tiles divide the shape, else XLA's ops")
    return LayerPath(XLA_FALLBACK, f"{choice.reason}; the Pallas kernel cannot run it: "
                                   f"{verdict.reason}")
  if not isinstance(choice.backend, (CublasMpBackend, AutoBackend)) or size == 1:
    return LayerPath(XLA_FALLBACK, choice.reason)
  # With "auto" each AllGather+GEMM runs fused or on XLA as measured for its
  # shape; the path below is the fused one, which the measured shapes take
  # where the fused op is faster (the compiled step's counts show which).
  per_shape = ("backend='auto', where autotune finds the fused op faster: "
               if isinstance(choice.backend, AutoBackend) else "")
  if not (reduce_scatter_layer or keep_gathered_input):
    return LayerPath(FUSED_WITH_ALL_GATHER,
                     per_shape + "a column-parallel layer gathers its input again in the "
                     "backward pass unless keep_gathered_input=True")
  route = gathered_route(choice.backend, config.reuse_gathered, size, dtype,
                         transpose_w=reduce_scatter_layer)
  return LayerPath(FUSED_WITH_REUSE if route.reuse else FUSED_WITH_ALL_GATHER,
                   per_shape + route.reason)


@dataclasses.dataclass(frozen=True)
class ExpectedCounts:
  """Collectives in one forward + backward of a sequence-parallel MLP block.

  ``standalone_all_gathers`` are ``all-gather`` ops in the compiled program;
  ``fused_all_gather_matmuls`` are cuBLASMp AllGather+GEMM custom calls.
  """
  standalone_all_gathers: int
  fused_all_gather_matmuls: int


def expected_all_gathers(config: CommGemmConfig, mesh, axis_name: str, dtype, *,
                         keep_gathered_input: bool = False) -> ExpectedCounts:
  """The all-gathers of one SP-MLP block's forward + backward (a training step).

  With cuBLASMp, two AllGather+GEMMs run fused (fc1's forward, fc2's dgrad),
  and the weight gradients add a standalone ``lax.all_gather`` each unless the
  operand is reused: 2 standalone without reuse, 1 with reuse (fc2's), 0 when
  fc1 also keeps its forward's gathered input.

  With the XLA fallback every gather is an ``all-gather`` op: fc1's forward
  gather and fc2's dgrad gather, 2 in all (fc1's backward gather of the same
  input is merged with the forward's by XLA's CSE, as with plain autodiff).
  """
  fc1 = layer_path(config, mesh, axis_name, dtype, keep_gathered_input=keep_gathered_input)
  fc2 = layer_path(config, mesh, axis_name, dtype, reduce_scatter_layer=True)
  if fc2.path == XLA_FALLBACK:
    return ExpectedCounts(2, 0)
  return ExpectedCounts(int(fc1.path != FUSED_WITH_REUSE) + int(fc2.path != FUSED_WITH_REUSE),
                        2)
