"""FP8 edges, on CPU: the recipe's checks, saturation, NaN/inf (the same
outputs spoiled as in bf16), values far outside E4M3's range, and the fp8
package's place below the layers."""

import ast
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jax_comm_gemm import CommGemmConfig, all_gather_matmul, matmul_reduce_scatter
from jax_comm_gemm.fp8 import (Fp8Recipe, fp8_all_gather_matmul, fp8_matmul_reduce_scatter,
                               saturating_cast, scale_from_amax)
from test_fp8 import RECIPES, TOL_DW, TOL_DX, TOL_FORWARD, _err, _normal, reference, run_op

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
N, K, M = 16, 8, 12


# --- the recipe -----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("scaling", "column"), ("scaling", None), ("forward_dtype", jnp.bfloat16),
    ("backward_dtype", "int8"), ("margin", -1), ("margin", 1.5), ("margin", True),
    ("gemm_form", "fast"),
])
def test_recipe_refuses_a_bad_field_by_name(field, value):
  with pytest.raises(ValueError, match=f"Fp8Recipe.{field}"):
    Fp8Recipe(**{field: value})


def test_recipe_is_hashable_and_normalizes_dtypes():
  a = Fp8Recipe(scaling="row", forward_dtype="float8_e4m3fn", margin=1)
  b = Fp8Recipe(scaling="row", forward_dtype=jnp.float8_e4m3fn, margin=1)
  assert a == b and hash(a) == hash(b) and len({a, b, Fp8Recipe()}) == 2
  assert a.forward_dtype == jnp.dtype(E4) and a.backward_dtype == jnp.dtype(E5)
  with pytest.raises(Exception):
    a.margin = 2  # frozen


# --- saturation and scales --------------------------------------------------------

def test_saturating_cast_clips_to_the_fp8_max():
  """Beyond the range after scaling: clipped to +-max (E4M3 has no inf; a
  plain cast makes NaN of it); NaN stays NaN."""
  v = jnp.array([1000.0, -1e6, 448.0, 465.0, jnp.inf, -jnp.inf, jnp.nan, 1.0])
  got = np.asarray(saturating_cast(v, jnp.float32(1.0), E4).astype(jnp.float32))
  # Exact: saturation lands on the FP8 maxima themselves.
  np.testing.assert_array_equal(got[:6], [448, -448, 448, 448, 448, -448])
  assert np.isnan(got[6]) and got[7] == 1.0
  assert np.isnan(float(jnp.float32(1000.0).astype(E4)))  # why the clip is there
  got5 = np.asarray(saturating_cast(v, jnp.float32(1.0), E5).astype(jnp.float32))
  np.testing.assert_array_equal(got5[[0, 1, 4]], [1024, -57344, 57344])


def test_scale_from_amax():
  """448/amax, /2**margin; amax 0 -> 1; inf -> 0; NaN -> NaN."""
  a = jnp.array([4.0, 0.0, jnp.inf, jnp.nan])
  s = np.asarray(scale_from_amax(a, E4))
  assert s[0] == 112.0 and s[1] == 1.0 and s[2] == 0.0 and np.isnan(s[3])
  # Exact: a division of small powers of two and integers, correctly rounded.
  assert float(scale_from_amax(jnp.float32(4.0), E4, margin=2)) == 28.0
  assert float(scale_from_amax(jnp.float32(4.0), E5)) == 57344.0 / 4


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("magnitude", [1e6, 1e-5], ids=["huge", "tiny"])
def test_values_outside_e4m3_range_are_scaled_in(magnitude, op, scaling):
  """x of magnitude 1e6 (beyond E4M3's 448) or 1e-5 (below its normals): the
  current scale maps it into range, within the usual tolerances."""
  x, w, ct = _normal(11, [(N * 2, K), (K, M), (N * 2, M)], [jnp.float32] * 3)
  x = x * magnitude
  got = run_op(op, cpu_mesh(2), x, w, ct, recipe=RECIPES[scaling])
  for g, r, tol in zip(got, reference(x, w, ct), (TOL_FORWARD, TOL_DX, TOL_DW[scaling, op])):
    assert _err(g, r) <= tol


# --- NaN and inf: the outputs bf16 spoils are NaN in FP8 too ---------------------------

def _outputs(op, x, w, fp8_recipe):
  """(y, dx, dw) of the FP8 op, or with fp8_recipe None of the bf16 XLA op."""
  mesh = cpu_mesh(2)
  config = CommGemmConfig(backend="xla")
  if op == "ag":
    f = (lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=fp8_recipe)) if fp8_recipe \
        else (lambda x, w: all_gather_matmul(x, w, "tp", config=config))
    specs, out = (P("tp"), P(None, "tp")), P(None, "tp")
  else:
    f = (lambda x, w: fp8_matmul_reduce_scatter(x, w, "tp", recipe=fp8_recipe)) \
        if fp8_recipe else (lambda x, w: matmul_reduce_scatter(x, w, "tp", config=config))
    specs, out = (P(None, "tp"), P("tp")), P("tp")
  g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out)

  @jax.jit
  def run(x, w):
    y, vjp = jax.vjp(g, x, w)
    return (y,) + vjp(jnp.ones_like(y))

  return run(x, w)


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("where", ["x", "w"])
def test_nan_and_inf_spoil_what_bf16_spoils(where, op, scaling):
  """A NaN and an inf in x (or a NaN in w): every output and gradient element
  that bf16 makes non-finite is NaN in FP8; with "row" exactly those (but
  fc1's weight gradient, from row-scaled gathered x requantized per column:
  all of it), with "tensor" all that the spoiled scale touches (a superset)."""
  x, w = _normal(12, [(N, K), (K, M)], [jnp.bfloat16, jnp.float32])
  if where == "x":
    x = x.at[3, 5].set(jnp.nan).at[12, 2].set(jnp.inf)
  else:
    w = w.at[2, 4].set(jnp.nan)
  bf16 = _outputs(op, x, w.astype(jnp.bfloat16), None)
  fp8 = _outputs(op, x, w, RECIPES[scaling])
  spoiled_any = False
  for name, b, f in zip(("y", "dx", "dw"), bf16, fp8):
    bad_b = ~np.isfinite(np.asarray(b, np.float32))
    bad_f = ~np.isfinite(np.asarray(f, np.float32))
    spoiled_any |= bad_b.any()
    assert np.all(np.isnan(np.asarray(f, np.float32))[bad_f]), f"{name}: inf, not NaN"
    assert not np.any(bad_b & ~bad_f), f"{name}: bf16 non-finite where FP8 is finite"
    if scaling == "row" and not (op, name) == ("ag", "dw"):
      np.testing.assert_array_equal(bad_f, bad_b, err_msg=name)  # masks: exact
    elif bad_b.any() and scaling == "tensor":
      assert bad_f.all(), f"{name}: per-tensor scaling spoils the whole output"
  assert spoiled_any


# --- the package's place ------------------------------------------------------------

FP8 = pathlib.Path(__file__).resolve().parent.parent / "jax_comm_gemm" / "fp8"
# validation.py imports nothing of the package (checked below), so the FP8 ops
# check their arguments through it without reaching up.
ALLOWED = ("jax", "numpy", "jax_comm_gemm.vma", "jax_comm_gemm.ring", "jax_comm_gemm.validation",
           "jax_comm_gemm.runtime", "jax_comm_gemm.fp8")


@pytest.mark.parametrize("path", sorted(FP8.glob("*.py")), ids=lambda p: p.name)
def test_fp8_package_imports_downwards_only(path):
  """jax, numpy, the standard library, vma/ring/validation/runtime, itself;
  top-level only; at most 300 lines."""
  text = path.read_text()
  assert text.count("\n") <= 300
  tree = ast.parse(text)
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node)), \
          f"{path.name}: import inside {node.name}"
    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
             else [f"{node.module}.{a.name}" for a in node.names]
             if isinstance(node, ast.ImportFrom) else [])
    for name in names:
      top = name.split(".")[0]
      ok = (top == "__future__" or top in sys.stdlib_module_names
            or any(name == a or name.startswith(a + ".") for a in ALLOWED))
      assert ok and name != "jax_comm_gemm", f"{path.name} imports {name}"


def test_validation_imports_nothing_of_the_package():
  text = (FP8.parent / "validation.py").read_text()
  assert not re.search(r"^\s*(from|import)\s+jax_comm_gemm", text, re.MULTILINE)
