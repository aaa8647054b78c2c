"""Python's table of shared values agrees with the C++ extension's own.

``jax_comm_gemm.runtime.constants`` is Python's table; ``jax_comm_gemm._constants``
exports what the handlers are compiled with (xla_ffi/constants.h, which
holds the algorithms too), and that module loads without a GPU. Each test compares the two
sides, or one of them with cuBLASMp's header, so that a number or name changed
on one side only fails here. Where CI builds the extension
(JCG_REQUIRE_EXTENSION=1), the module must import and answer.
"""

import ast
import os
import pathlib
import re

import pytest

from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.runtime import constants, native

REQUIRED = os.environ.get("JCG_REQUIRE_EXTENSION") == "1"
# Every table the extension exports; a new one needs a Python counterpart here.
EXPORTED = {"targets", "algorithms", "cublasmp_algorithm_types", "layouts"}


@pytest.fixture(scope="module")
def extension():
  module = native.load_constants()
  if module is None:
    if REQUIRED:
      pytest.fail("jax_comm_gemm._constants was not built, but JCG_REQUIRE_EXTENSION=1")
    pytest.skip("the extension is not built here")
  return module.constants()


def test_extension_was_built():
  """Where CI builds the C++ extension, both modules are in the package."""
  if not REQUIRED:
    pytest.skip("set JCG_REQUIRE_EXTENSION=1 where the extension must be built")
  assert native.built(), "jax_comm_gemm._comm_gemm was not built"
  assert native.load_constants() is not None


def test_the_extension_exports_the_tables_compared_here(extension):
  assert set(extension) == EXPORTED


def test_targets_agree(extension):
  """The FFI target names Python registers and lowers to are the handlers'."""
  assert dict(extension["targets"]) == constants.TARGETS


def test_algorithm_names_and_numbers_agree(extension):
  """Each algorithm name has the number the handlers take, on both sides, and
  neither side offers one the other does not."""
  assert dict(extension["algorithms"]) == constants.ALGORITHMS


def test_layouts_agree(extension):
  """The `layout` attribute's numbers are the handlers' GatheredLayout values."""
  assert dict(extension["layouts"]) == constants.GATHERED_LAYOUTS


def test_the_config_offers_every_algorithm_for_both_ops():
  """Every algorithm runs both ops (the C++ tests check the handlers take
  them: test_constants.cc); the config takes each for either."""
  for name in constants.ALGORITHMS:
    assert CommGemmConfig(reduce_scatter=name).reduce_scatter == name
    assert CommGemmConfig(all_gather_algorithm=name).all_gather_algorithm == name
  with pytest.raises(ValueError, match=r"CommGemmConfig.all_gather_algorithm must be one of"):
    CommGemmConfig(all_gather_algorithm="pipelined")  # removed


def test_cublasmp_algorithms_are_cublasmps_enum_values(extension):
  """cuBLASMp's algorithms carry cublasMpMatmulAlgoType_t's values, by name
  ("split_p2p" is CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P); the own ones, and only
  they, are numbered clear of that enum."""
  enum = dict(extension["cublasmp_algorithm_types"])
  for name, number in constants.ALGORITHMS.items():
    if name in constants.OWN_ALGORITHMS:
      assert number not in enum.values(), f"{name}={number} collides with cuBLASMp's enum"
    else:
      assert enum.get(name.upper()) == number, f"{name}={number}, cuBLASMp's enum: {enum}"
  clear = {name for name, number in extension["algorithms"].items()
           if number not in enum.values()}
  assert clear == constants.OWN_ALGORITHMS


def _cublasmp_header() -> pathlib.Path | None:
  try:
    import nvidia  # noqa: PLC0415
  except ImportError:
    return None
  for base in nvidia.__path__:
    for found in sorted(pathlib.Path(base).glob("cublasmp/*/include/cublasmp.h")):
      return found
  return None


def test_the_exported_enum_is_cublasmp_h(extension):
  """The enum the extension exports is the one in the cuBLASMp wheel's
  cublasmp.h, read as text: the extension's copy of it cannot drift."""
  header = _cublasmp_header()
  if header is None:
    pytest.skip("no cuBLASMp wheel with its header here")
  text = header.read_text()
  in_header = {m[1]: int(m[2]) for m in
               re.finditer(r"CUBLASMP_MATMUL_ALGO_TYPE_(\w+)\s*=\s*(\d+)", text)}
  assert in_header, f"no cublasMpMatmulAlgoType_t values found in {header}"
  assert dict(extension["cublasmp_algorithm_types"]) == in_header


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_comm_gemm"
# Still mutable, and why: a test patches it item by item (test_autotune.py).
MUTABLE_FOR_NOW = {"backends/routes.py: CANDIDATES", "backends/routes.py: FP8_CANDIDATES"}


def _mutable_constants(source: str) -> list[str]:
  """The module-level constants (upper-case names) that `source` binds to a
  dict, list or set, which any importer could change for every other."""
  mutable = (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set, ast.SetComp)
  found = []
  for node in ast.parse(source).body:
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
    value = getattr(node, "value", None)
    built = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
             and value.func.id in ("dict", "list", "set"))
    for target in targets:
      if (isinstance(target, ast.Name) and re.fullmatch(r"_?[A-Z][A-Z0-9_]*", target.id)
          and (isinstance(value, mutable) or built)):
        found.append(target.id)
  return found


def test_the_constant_finder_finds_a_mutable_constant():
  assert _mutable_constants("A = {}\n_B: dict = dict(x=1)\nC = (1,)\n__all__ = []\n"
                            "D = frozenset()\nlower = []\n") == ["A", "_B"]


def test_module_level_constants_are_immutable():
  """Tables are MappingProxyType, tuples or frozensets."""
  found = {f"{path.relative_to(PACKAGE)}: {name}" for path in PACKAGE.rglob("*.py")
           for name in _mutable_constants(path.read_text())}
  assert found == MUTABLE_FOR_NOW
