"""Every value that Python and the C++ extension share is defined once.

Python keeps one table (``jax_comm_gemm.runtime.constants``); the extension's
own definitions come from ``jax_comm_gemm._constants``, a module that loads
without a GPU. Where CI builds the extension (JCG_REQUIRE_EXTENSION=1), the
module must import, answer, and agree with the table.
"""

import os

import pytest

from jax_comm_gemm.config import REDUCE_SCATTER_IMPLS
from jax_comm_gemm.runtime import constants, native

REQUIRED = os.environ.get("JCG_REQUIRE_EXTENSION") == "1"


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


@pytest.mark.parametrize("name, table", [
    ("targets", constants.TARGETS),
    ("algorithms", constants.ALGORITHMS),
    ("layouts", constants.GATHERED_LAYOUTS),
])
def test_tables_agree(extension, name, table):
  assert dict(extension[name]) == table, f"{name}: C++ {extension[name]} vs Python {table}"


def test_fences_agree_in_order(extension):
  """The fence list, default first, is the same on both sides."""
  assert tuple(extension["fences"]) == constants.FENCES


def test_multicast_algorithms_exist():
  assert constants.MULTICAST_ALGORITHMS <= set(constants.ALGORITHMS)


def test_own_algorithms_exist_and_run_all_gather_only():
  assert constants.OWN_ALGORITHMS <= set(constants.ALGORITHMS) <= set(REDUCE_SCATTER_IMPLS)
  assert set(constants.UNSAFE_FENCES) <= set(constants.FENCES)
