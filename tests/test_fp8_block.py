"""FP8 "block" scaling (1 x 128 activations and gradients, 128 x 128 weights),
on CPU: the blocks' quantization, the GEMM against float64 of the dequantized
operands (XLA's emulation and the custom call's CPU lowering, through the
scale layout cuBLASLt reads), the ops against float64 forward and gradients,
the ring against XLA's collectives, and what block scaling refuses. The
custom call itself runs in tests/gpu/one_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from conftest import cpu_mesh
from jax_comm_gemm.backends import CublasMpBackend
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter
from jax_comm_gemm.fp8.gemm import (BLK128, VEC128, _cublaslt_scales, cublaslt_gemm_tn,
                                    fp8_gemm_tn, weight_copies)
from jax_comm_gemm.fp8.quantize import BLOCK, dequantize, fp8_max, quantize_blocks
from test_fp8 import TOL_DW, TOL_DX, TOL_FORWARD, reference
from tolerance import assert_reduction_close

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCKED = Fp8Recipe("block")
N, K, M = 256, 256, 512  # tokens, input features, output features: multiples of 128


def _ramp(rows, cols, block_rows, seed):
  """Normal values whose blocks differ in magnitude by powers of two: a scale
  taken from another block is off by 2x or more."""
  g = jax.random.normal(jax.random.key(seed), (rows, cols))
  exponent = (jnp.arange(rows)[:, None] // block_rows + jnp.arange(cols)[None, :] // BLOCK) % 7
  return g * jnp.exp2(exponent - 3.0)


@pytest.mark.parametrize("block_rows", [1, BLOCK])
def test_each_block_has_its_own_scale(block_rows):
  x = _ramp(256, 384, block_rows, 0)
  q, inv = quantize_blocks(x, E4, block_rows)
  assert inv.shape == (256 // block_rows, 3)
  blocks = np.asarray(q.astype(jnp.float32)).reshape(256 // block_rows, block_rows, 3, BLOCK)
  # Every block's largest magnitude lands on the FP8 maximum (exact: amax times
  # fp8_max / amax is within a float32 ulp of fp8_max, which rounds and clips to it).
  np.testing.assert_array_equal(np.abs(blocks).max(axis=(1, 3)), fp8_max(E4))
  # Each value within E4M3's rounding of itself, or of the block's subnormal step.
  err = np.abs(np.asarray(dequantize(q, inv)) - np.asarray(x))
  step = np.asarray(dequantize(jnp.ones(q.shape, E4), inv)) * 2.0 ** -9
  assert np.all(err <= np.abs(np.asarray(x)) * 2.0 ** -4 + step)


def test_the_weight_copies_are_one_quantization_transposed():
  fwd8, fwd_inv, bwd8, bwd_inv = weight_copies(_ramp(256, 384, BLOCK, 1), E4,
                                               scaling="block", transpose_w=False)
  assert fwd8.shape == (384, 256) and fwd_inv.shape == (3, 2)
  # Exact: the backward copy is the forward's bytes and scales, transposed.
  np.testing.assert_array_equal(np.asarray(bwd8.astype(jnp.float32)),
                                np.asarray(fwd8.astype(jnp.float32)).T)
  np.testing.assert_array_equal(np.asarray(bwd_inv), np.asarray(fwd_inv).T)


def test_cublaslt_reads_the_scales_in_its_own_layout():
  """1 x 128: the rows fastest ([k/128, rows]); 128 x 128: the k blocks
  fastest, padded to a multiple of 4 ([rows/128, 4])."""
  inv = jnp.arange(6.0).reshape(2, 3)  # a transpose and a pad: exact
  np.testing.assert_array_equal(_cublaslt_scales(inv, VEC128), [[0, 3], [1, 4], [2, 5]])
  np.testing.assert_array_equal(_cublaslt_scales(inv, BLK128), [[0, 1, 2, 0], [3, 4, 5, 0]])


@pytest.mark.parametrize("b_rows", [BLOCK, 1])
@pytest.mark.parametrize("dtypes", [(E4, E4), (E5, E4), (E4, E5)])
def test_block_gemm_matches_float64(b_rows, dtypes):
  """XLA's emulation and the custom call (lowered for the CPU, its scales
  through cuBLASLt's layout and back) against float64 of the dequantized
  operands."""
  (a8, ia), (b8, ib) = (quantize_blocks(_ramp(256, 384, 1, 2), dtypes[0], 1),
                        quantize_blocks(_ramp(128, 384, b_rows, 3), dtypes[1], b_rows))
  ref = (np.asarray(dequantize(a8, ia), np.float64)
         @ np.asarray(dequantize(b8, ib), np.float64).T)
  for got in (fp8_gemm_tn(a8, b8, ia, ib, jnp.float32),
              fp8_gemm_tn(a8, b8, ia, ib, jnp.float32, form="cublaslt"),
              cublaslt_gemm_tn(a8, b8, ia, ib, out_dtype=jnp.float32, fast_accum=False)):
    err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def _run(op, mesh, x, w, ct, recipe, collectives="xla"):
  if op == "ag":
    f = lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=recipe, collectives=collectives)
    specs, out_spec = (P("tp"), P(None, "tp")), P(None, "tp")
  else:
    f = lambda x, w: fp8_matmul_reduce_scatter(x, w, "tp", recipe=recipe,
                                               collectives=collectives)
    specs, out_spec = (P(None, "tp"), P("tp")), P("tp")
  g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_spec)

  def loss(x, w):
    y = g(x, w)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  return y, dx, dw


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_the_ops_match_float64_and_the_ring_matches_xla(op):
  """Forward, dx and dw within the FP8 tolerances ("row"'s: the weight
  gradient's operand is requantized in blocks along the tokens), with blocks
  of very different magnitudes; the ring computes what XLA's collectives do."""
  mesh = cpu_mesh(2)
  x = _ramp(N, K, 1, 4).astype(jnp.bfloat16)
  w = _ramp(K, M, BLOCK, 5) / np.sqrt(K)
  ct = _ramp(N, M, 1, 6)
  got = _run(op, mesh, x, w, ct, BLOCKED)
  for name, g, r, tol in zip(("y", "dx", "dw"), got, reference(x, w, ct),
                             (TOL_FORWARD, TOL_DX, TOL_DW["row", op])):
    err = np.abs(np.asarray(g, np.float64) - r).max() / np.abs(r).max()
    assert err <= tol, f"{name}: {err:.4f} > {tol:.4f}"
  # The ring's program and XLA's cast the inputs themselves (nothing computed
  # before a cast: no code can flip): their GEMMs' float32 sums apart, in x's
  # dtype (bf16) where they are written in it (tests/tolerance.py).
  ring = _run(op, mesh, x, w, ct, BLOCKED, "ring")
  for name, g, r in zip(("y", "dx", "dw"), ring, got):
    assert_reduction_close(g, r, k=max(N, K, M), out_dtype=g.dtype, what=name)


def test_what_block_scaling_cannot_run_is_refused():
  mesh = cpu_mesh(2)
  f = lambda w: jax.shard_map(
      lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=BLOCKED), mesh=mesh,
      in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(jnp.ones((N, K)), w)
  with pytest.raises(ValueError, match=r"'block' scaling quantizes in blocks of 128: w's "
                                       r"dims and the tokens .* got w \(256, 96\)"):
    jax.eval_shape(f, jnp.ones((K, 192)))
  with pytest.raises(ValueError, match=r"fused FP8 ops take one scale per tensor"):
    jax.eval_shape(jax.shard_map(
        lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=BLOCKED,
                                           collectives=CublasMpBackend()),
        mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")),
        jnp.ones((N, K)), jnp.ones((K, M)))
  with pytest.raises(ValueError, match=r"backend 'cublasmp' runs FP8 with one scale"):
    jcg.CommGemmConfig(backend="cublasmp", fp8=BLOCKED)
