"""jax's own Pallas Mosaic GPU AllGather+GEMM (``all_gather_lhs_matmul``) as one
more implementation ``auto`` may choose: one kernel that sends each shard on
from shared memory while it multiplies it, so a call pays no host time per
transfer (where it leads: docs/performance.md). The other op and the weight
gradient stay XLA's, and so does the AllGather+GEMM where the kernel cannot
run (:func:`supports` says why)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_comm_gemm import vma
from jax_comm_gemm.backends.xla import XlaBackend
from jax_comm_gemm.runtime.capability import Capability

NAME = "pallas_mgpu"
DTYPES = ("bfloat16", "float16")
# The tile configuration (of those benchmarks/peers/pallas_mgpu.py tried, the
# fastest that fits a Hopper SM's shared memory): a CTA computes 128 rows by
# 2 x 128 columns, stepping 64 along k, which sets what a shape must divide.
TILE_M, TILE_N, TILE_K = 128, 128, 64
ROWS_DIVIDE, COLUMNS_DIVIDE = TILE_M, 2 * TILE_N


def _kernel():
  """(jax's kernel function, its tile configuration), or (None, why not)."""
  try:
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as collective
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as matmul
    config = matmul.TuningConfig(
        tile_m=TILE_M, tile_n=TILE_N, tile_k=TILE_K, max_concurrent_steps=4,
        grid_minor_dim=matmul.MatmulDimension.M, grid_tile_width=8,
        wg_dimension=matmul.MatmulDimension.N)
    return collective.all_gather_lhs_matmul, config
  except Exception as e:  # noqa: BLE001  (experimental modules: absent, moved or changed)
    return None, f"jax's kernel is not there ({type(e).__name__}: {e})"


def supports(rows: int, k: int, m: int, dtype, transpose_w: bool, gathered: bool,
             axis_size: int) -> Capability:
  """Whether the kernel can run an AllGather+GEMM of a rank's x [rows, k] with
  w [k, m] (m: the rank's output columns) over an axis of `axis_size`."""
  verdict = supports_layer(dtype, transpose_w, gathered, axis_size)
  if not verdict.ok:
    return verdict
  bad = [f"{what} {size} by {by}" for what, size, by in
         (("rows", rows, ROWS_DIVIDE), ("columns", m, COLUMNS_DIVIDE), ("k", k, TILE_K))
         if size % by]
  if bad:
    return Capability(False, f"its tiles need {', '.join(bad)} to divide")
  return verdict


def supports_layer(dtype, transpose_w: bool, gathered: bool, axis_size: int) -> Capability:
  """:func:`supports` but for the shape: whether the kernel can run a layer's
  AllGather+GEMM where its tiles divide the shape (the per-layer report)."""
  if transpose_w:
    return Capability(False, "the kernel takes w as [k, m]; w is transposed")
  if gathered:
    return Capability(False, "the kernel does not hand out the gathered operand")
  if jnp.dtype(dtype).name not in DTYPES:
    return Capability(False, f"the kernel runs {' and '.join(DTYPES)}, not "
                             f"{jnp.dtype(dtype).name}")
  devices = jax.devices()
  capability = getattr(devices[0], "compute_capability", "")
  if devices[0].platform != "gpu" or not str(capability).startswith("9."):
    return Capability(False, f"it runs on Hopper GPUs (compute capability 9.x), not on "
                             f"{devices[0].device_kind}")
  # On a mesh of one the kernel has no peer addresses and asks for NVSHMEM,
  # which XLA lacks ("NVSHMEM is not supported in XLA").
  if axis_size == 1:
    return Capability(False, "a group of one gathers nothing")
  # The kernel signals peers by their index on its axis, as device ids.
  if axis_size != jax.device_count():
    return Capability(False, f"its axis must span all {jax.device_count()} devices "
                             f"(it has {axis_size})")
  # Its peers' addresses come from XLA ("collective metadata") with one
  # process per GPU or one for all; other layouts the kernel refuses.
  if jax.process_count() not in (1, jax.device_count()):
    return Capability(False, "it needs one process per GPU or one process for all")
  kernel, why = _kernel()
  if kernel is None:
    return Capability(False, why)
  return Capability(True, "jax's Mosaic GPU kernel runs it")


@dataclasses.dataclass(frozen=True)
class PallasBackend(XlaBackend):
  """The AllGather+GEMM by jax's Pallas Mosaic GPU kernel where it can run;
  everything else by XLA.

  >>> PallasBackend().name
  'pallas_mgpu'
  """

  name = NAME

  def all_gather_matmul(self, x, w, axis_name, *, transpose_w, return_gathered,
                        precision=None):
    m = w.shape[0] if transpose_w else w.shape[1]
    verdict = supports(x.shape[0], x.shape[1], m, x.dtype, transpose_w, return_gathered,
                       jax.lax.axis_size(axis_name))
    if not verdict.ok:
      return super().all_gather_matmul(x, w, axis_name, transpose_w=transpose_w,
                                       return_gathered=return_gathered, precision=precision)
    kernel, config = _kernel()
    # bf16/f16 with float32 accumulation: `precision` is moot here.
    x, w = vma.match(x, w)
    y = kernel(x, w, axis_name, config=config, dtype=x.dtype)
    return vma.pvary(y, vma.varying_axes(x))
