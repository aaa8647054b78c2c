"""Numerics of the differentiable collective matmuls, forward and backward.

Every case runs the op inside ``jax.shard_map`` under ``jax.jit`` twice, once
plainly (the custom_vjp's primal path) and once under ``jax.value_and_grad``
(its fwd/bwd rules), and compares outputs and gradients with the plain
``x @ w`` on one device in float64, differentiated by ``jax.grad``. Each
routing of the gathered operand is covered: XLA reusing it or gathering again,
and the emulated fused op exposing it or not.
"""

import warnings
import zlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from fused_emulation import ROUTINGS, check_against_reference, random_inputs
from jax_comm_gemm import all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.backends import resolve_backend

N, K, M = 32, 16, 24  # global tokens, input features, output features
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _check_against_reference(mesh, local, in_specs, out_specs, reference, args,
                             out_shapes, dtype, seed):
  """Runs `local` in shard_map, plain and differentiated, against `reference`."""
  sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  check_against_reference(sharded, reference, args, out_shapes, dtype, seed,
                          arg_names=("x", "w"))


def _run_all_gather_matmul(mesh, dtype, routing, *, transpose_w=False,
                           return_gathered=False, keep_gathered_input=False):
  size = mesh.shape["tp"]
  config = ROUTINGS[routing]
  seed = _seed("ag", size, dtype, routing, transpose_w, return_gathered,
               keep_gathered_input)
  x, w = random_inputs(seed, [(N, K), (M, K) if transpose_w else (K, M)], dtype)

  def local(x, w):
    out = all_gather_matmul(x, w, "tp", transpose_w=transpose_w,
                            return_gathered=return_gathered,
                            keep_gathered_input=keep_gathered_input, config=config)
    # Each shard's gathered x, stacked: the gradient through it differs per shard.
    return (out[0], out[1][None]) if return_gathered else (out,)

  def reference(x, w):
    y = x @ (w.T if transpose_w else w)
    return (y, jnp.broadcast_to(x, (size, N, K))) if return_gathered else (y,)

  w_spec = P("tp", None) if transpose_w else P(None, "tp")
  out_specs = (P(None, "tp"), P("tp")) if return_gathered else (P(None, "tp"),)
  out_shapes = [(N, M), (size, N, K)][:len(out_specs)]
  # Keeping the gathered input where the fused op cannot hand it out falls back
  # to lax.all_gather in the forward pass, and says so; otherwise no warning.
  warns = keep_gathered_input and not resolve_backend(config).gathered_reuse(size, dtype,
                                                                       transpose_w).ok
  with (pytest.warns(RuntimeWarning, match="keep_gathered_input=True") if warns
        else warnings.catch_warnings()):
    if not warns:
      warnings.simplefilter("error", RuntimeWarning)
    _check_against_reference(mesh, local, (P("tp", None), w_spec), out_specs,
                             reference, (x, w), out_shapes, dtype, seed)


def _run_matmul_reduce_scatter(mesh, dtype, routing, *, transpose_w=False):
  config = ROUTINGS[routing]
  seed = _seed("rs", mesh.shape["tp"], dtype, routing, transpose_w)
  x, w = random_inputs(seed, [(N, K), (M, K) if transpose_w else (K, M)], dtype)

  def local(x, w):
    return (matmul_reduce_scatter(x, w, "tp", transpose_w=transpose_w, config=config),)

  def reference(x, w):
    return (x @ (w.T if transpose_w else w),)

  w_spec = P(None, "tp") if transpose_w else P("tp", None)
  _check_against_reference(mesh, local, (P(None, "tp"), w_spec), (P("tp", None),),
                           reference, (x, w), [(N, M)], dtype, seed)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_all_gather_matmul_matches_reference(tp_mesh, dtype, routing):
  """AG(x) @ w and its gradients equal the unsharded x @ w on 2, 4, 8 devices."""
  _run_all_gather_matmul(tp_mesh, dtype, routing)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matmul_reduce_scatter_matches_reference(tp_mesh, dtype, routing):
  """RS(x @ w) and its gradients equal the unsharded x @ w on 2, 4, 8 devices."""
  _run_matmul_reduce_scatter(tp_mesh, dtype, routing)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("keep_gathered_input", [False, True], ids=["regather", "keep"])
@pytest.mark.parametrize("return_gathered", [False, True], ids=["y", "y_and_gathered"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w", "wT"])
def test_all_gather_matmul_flags(transpose_w, return_gathered, keep_gathered_input,
                                 routing):
  """Every combination of transpose_w, return_gathered and keep_gathered_input
  gives the reference outputs and gradients, including the gradient that flows
  in through the returned gathered input (fp32, 4 devices)."""
  _run_all_gather_matmul(cpu_mesh(4), jnp.float32, routing, transpose_w=transpose_w,
                         return_gathered=return_gathered,
                         keep_gathered_input=keep_gathered_input)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_all_gather_matmul_all_flags_bf16(routing):
  """The same with every flag on, in bf16 (8 devices)."""
  _run_all_gather_matmul(cpu_mesh(8), jnp.bfloat16, routing, transpose_w=True,
                         return_gathered=True, keep_gathered_input=True)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matmul_reduce_scatter_transposed_weight(dtype, routing):
  """RS(x @ w.T) with w stored [out, in] (4 devices)."""
  _run_matmul_reduce_scatter(cpu_mesh(4), dtype, routing, transpose_w=True)


def test_gradient_through_gathered_output_only():
  """A loss of the returned gathered input alone (y unused: a symbolic-zero
  cotangent) gives dx = the reduce-scattered cotangent and dw = exact zeros."""
  mesh = cpu_mesh(4)
  x, w = random_inputs(_seed("gathered_only"), [(N, K), (K, M)], jnp.float32)

  def local(x, w):
    _, gathered = all_gather_matmul(x, w, "tp", return_gathered=True)
    return (gathered[None],)

  def reference(x, w):
    return (jnp.broadcast_to(x, (4, N, K)) + 0 * jnp.sum(w),)

  _check_against_reference(mesh, local, (P("tp", None), P(None, "tp")), (P("tp"),),
                           reference, (x, w), [(4, N, K)], jnp.float32, 11)


@pytest.mark.parametrize("routing", ["xla", "fused_hidden"])
def test_operands_replicated_along_the_axis(routing):
  """Operands that do not vary along the axis get their gradients summed over
  it: a replicated weight of all_gather_matmul (as a kernel is along a data
  axis), and replicated x and w of matmul_reduce_scatter (every shard computes
  the whole x @ w and the reduce-scatter sums the 4 copies)."""
  mesh = cpu_mesh(4)
  config = ROUTINGS[routing]
  seed = _seed("replicated", routing)
  args = random_inputs(seed, [(N, K), (K, M), (N, K), (K, M)], jnp.float32)

  def local(x, w, h, v):
    y = all_gather_matmul(x, w, "tp", config=config)
    return y[None], matmul_reduce_scatter(h, v, "tp", config=config)

  def reference(x, w, h, v):
    return jnp.broadcast_to(x @ w, (4, N, M)), 4 * (h @ v)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(), P(), P()),
                          out_specs=(P("tp"), P("tp")))
  check_against_reference(sharded, reference, args, [(4, N, M), (N, M)],
                          jnp.float32, seed, arg_names=("x", "w", "h", "v"))
