"""The public API explains itself: every public function and class has a
docstring with an example (the examples run as doctests in ``make test``),
and the package reaches into jax's private modules in one place only."""

import importlib
import inspect
import pathlib
import re
import types

import pytest

PUBLIC_MODULES = ("jax_comm_gemm", "jax_comm_gemm.backends", "jax_comm_gemm.runtime",
                  "jax_comm_gemm.diagnostics", "jax_comm_gemm.linen", "jax_comm_gemm.nnx",
                  "jax_comm_gemm.sharded", "jax_comm_gemm.dense", "jax_comm_gemm.hlo",
                  "jax_comm_gemm.fp8")
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_comm_gemm"


def _missing_examples(module) -> list[str]:
  """The public functions and classes of `module` (its ``__all__``, else its
  names without a leading underscore) whose docstring has no example."""
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n in vars(module) if not n.startswith("_")]
  values = [(name, getattr(module, name)) for name in names]
  return [name for name, value in values
          if (inspect.isfunction(value) or inspect.isclass(value))
          and ">>>" not in (inspect.getdoc(value) or "")]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_function_and_class_has_an_example(module_name):
  missing = _missing_examples(importlib.import_module(module_name))
  assert not missing, f"{module_name}: no docstring example for {', '.join(missing)}"


PLANTED = '''
def documented():
  """Does nothing.

  >>> documented()
  """

def undocumented():
  """Does nothing."""

class Undocumented:
  pass

def _private():
  pass

LIMIT = 3
'''


def test_the_example_finder_sees_a_missing_example():
  module = types.ModuleType("planted")
  exec(PLANTED, vars(module))  # noqa: S102  (the test's own source)
  assert _missing_examples(module) == ["undocumented", "Undocumented"]
  module.__all__ = ["documented", "LIMIT"]
  assert _missing_examples(module) == []


def test_jax_private_modules_are_imported_in_one_module():
  """jax has no public key-value store API: runtime/kv.py reaches into jax._src
  for it, and says which jax versions it was tested with. Nowhere else."""
  private = re.compile(r"^\s*(from|import)\s+jax\._src", re.MULTILINE)
  users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if private.search(p.read_text()))
  assert users == ["runtime/kv.py"]
  assert re.search(r"[Tt]ested with jax 0\.10\.2 and 0\.11\.2", (PACKAGE / "runtime/kv.py").read_text())

