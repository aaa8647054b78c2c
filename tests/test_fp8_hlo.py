"""The FP8 MLP block (fc1 fp8_all_gather_matmul -> gelu -> fc2
fp8_matmul_reduce_scatter) as it shows in the program: all-gathers of FP8,
bf16's counts kept, TN GEMMs, no FP8 transpose of a weight.

Counted in ``jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))`` of the
block in ``jax.shard_map`` on 2 CPU devices, as tests/test_routing_hlo.py
counts bf16's:

* with an opaque stand-in for the gathers that feed a GEMM (what a fused
  AllGather+GEMM does; bits moved as unsigned integers behind an optimization
  barrier, as fused_emulation.EmulatedFusedBackend does, so that XLA cannot
  merge them with a standalone one), the standalone all-gathers are those of
  bf16 on EmulatedFusedBackend: 1 (fc1's wgrad re-gathers x; fc2's wgrad
  reuses the gathered dy), 0 with keep_gathered_input, 2 without reuse;
* with plain ``lax.all_gather`` XLA merges fc1's re-gather with its forward
  gather, as it does in bf16: the same total as bf16 on the XLA backend.

Element types: the lowered program's data all-gathers are f8 (E4M3 x, E5M2
dy) and "row"'s scale all-gathers f32, one beside each. XLA:CPU then widens
FP8 collectives to f16 (it has no FP8 arithmetic), so the compiled CPU HLO is
counted, the lowered one typed.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from fused_emulation import SCOPE, EmulatedFusedBackend
from jax_comm_gemm import CommGemmConfig, all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.fp8 import Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter

N, K, F = 16, 8, 16
RECIPES = {"tensor": Fp8Recipe(), "row": Fp8Recipe(scaling="row")}
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def opaque_gather(tree, axis_name):
  """lax.all_gather that XLA cannot merge with another (see the docstring)."""
  with jax.named_scope(SCOPE):
    tree = lax.optimization_barrier(tree)
    bits = tuple(lax.bitcast_convert_type(t, _UINT[t.dtype.itemsize]) for t in tree)
    out = lax.all_gather(bits, axis_name, axis=0, tiled=True)
    return tuple(lax.bitcast_convert_type(o, t.dtype) for o, t in zip(out, tree))


def _args():
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (N, K), jnp.bfloat16),
          jax.random.normal(keys[1], (K, F)), jax.random.normal(keys[2], (F, K)))


def mlp_step(size=2, recipe=None, keep=False, reuse=True, gather=None, config=None):
  """jit(value_and_grad) of the block: FP8 with `recipe`, else bf16 with `config`."""
  def local(x, w1, w2):
    if recipe is None:
      h = all_gather_matmul(x, w1.astype(x.dtype), "tp", keep_gathered_input=keep,
                            config=config)
      return matmul_reduce_scatter(jax.nn.gelu(h), w2.astype(x.dtype), "tp", config=config)
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, keep_gathered_input=keep,
                              gather=gather)
    return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe,
                                     reuse_gathered=reuse, gather=gather)

  block = jax.shard_map(local, mesh=cpu_mesh(size), in_specs=(P("tp"), P(None, "tp"), P("tp")),
                        out_specs=P("tp"))
  loss = lambda *a: jnp.sum(block(*a).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


_LHS = re.compile(r"=\s*(.*?)\s(all-gather|all-gather-start|reduce-scatter|all-reduce)\(")


def compiled_collectives(step):
  """(opcode, element type, rank, inside SCOPE) per operand of each collective
  in the compiled HLO (a combined collective counts once per operand)."""
  out = []
  for line in step.lower(*_args()).compile().as_text().splitlines():
    m = _LHS.search(line)
    if m:
      for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1)):
        out.append((m.group(2).replace("-start", ""), dtype, len(dims.split(",")),
                    SCOPE in line))
  return out


def standalone_data_all_gathers(step) -> int:
  """Standalone all-gathers of 2-D data (the 1-D ones are "row"'s scales)."""
  return sum(op == "all-gather" and rank == 2 and not scoped
             for op, _, rank, scoped in compiled_collectives(step))


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("keep, reuse, standalone, bf16_standalone", [
    (False, True, 1, 1), (True, True, 0, 0), (False, False, 2, 2),
    # bf16's config.reuse_gathered=False also refuses keep's hand-out (its
    # forward then all-gathers x apart); FP8's keep_gathered_input is its own.
    (True, False, 1, 2)],
    ids=["reuse", "reuse_keep", "no_reuse", "no_reuse_keep"])
def test_standalone_all_gathers_match_bf16(keep, reuse, standalone, bf16_standalone,
                                           scaling):
  """Standalone all-gathers of the block, fused ones opaque: bf16's counts."""
  bf16 = CommGemmConfig(backend=EmulatedFusedBackend(expose=True),
                        reuse_gathered=None if reuse else False)
  assert standalone_data_all_gathers(mlp_step(config=bf16, keep=keep)) == bf16_standalone
  step = mlp_step(recipe=RECIPES[scaling], keep=keep, reuse=reuse, gather=opaque_gather)
  ops = compiled_collectives(step)
  assert standalone_data_all_gathers(step) == standalone, ops
  fused = [d for op, d, rank, scoped in ops if op == "all-gather" and scoped and rank == 2]
  assert fused == ["u8", "u8"], ops  # fc1 forward, fc2 dgrad: FP8 bytes
  scales = sum(op == "all-gather" and rank == 1 for op, _, rank, _ in ops)
  assert scales == (standalone + 2 if scaling == "row" else 0), ops


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep"])
def test_xla_all_gathers_match_bf16_and_are_fp8(keep, scaling):
  """Plain lax.all_gather: as many data all-gathers as bf16 on the XLA backend
  (2), and in the lowered program every data all-gather is FP8."""
  bf16 = standalone_data_all_gathers(mlp_step(config=CommGemmConfig(backend="xla"), keep=keep))
  step = mlp_step(recipe=RECIPES[scaling], keep=keep)
  assert standalone_data_all_gathers(step) == bf16 == 2
  lowered = step.lower(*_args()).as_text()
  types = re.findall(r"stablehlo.all_gather.*?->\s*tensor<[0-9x]*x?(\w+)>", lowered)
  data = [t for t in types if t != "f32"]
  assert data and set(data) <= {"f8E4M3FN", "f8E5M2"}, types
  assert "f8E4M3FN" in data and "f8E5M2" in data  # x forward, dy backward
  assert types.count("f32") == (len(data) if scaling == "row" else 0), types


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _is_f8(var) -> bool:
  return "float8" in str(getattr(var.aval, "dtype", ""))


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("size", [1, 2], ids=["tp1", "tp2"])
def test_gemms_are_fp8_tn_and_no_weight_is_transposed_in_fp8(size, scaling):
  """The block's 6 GEMMs (3 per layer) are FP8 and contract both operands on
  their last axis; the only FP8 transposes are the weight gradients' copies of
  the gathered x and dy under one scale ("tensor"; "row" requantizes them
  transposed from float32): no weight copy is an FP8 transpose."""
  step = mlp_step(size=size, recipe=RECIPES[scaling])
  eqns = list(_eqns(jax.make_jaxpr(step)(*_args()).jaxpr))
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 6
  for e in dots:
    assert all(_is_f8(v) for v in e.invars), e
    assert e.params["dimension_numbers"] == (((1,), (1,)), ((), ())), e
  f8_transposes = [e for e in eqns if e.primitive.name == "transpose" and _is_f8(e.invars[0])]
  assert len(f8_transposes) == (2 if scaling == "tensor" else 0)


@pytest.mark.parametrize("scaling", RECIPES)
def test_group_of_one_communicates_nothing(scaling):
  """tp = 1: no collective at all in the compiled block (the same FP8 GEMMs:
  see the test above)."""
  assert compiled_collectives(mlp_step(size=1, recipe=RECIPES[scaling])) == []
