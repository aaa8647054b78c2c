"""The public API explains itself: every public function and class has a
docstring with an example (the examples run as doctests in ``make test``),
and the package reaches into jax's private modules in one place only."""

import ast
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



# The top level: what a user of a tensor-parallel layer needs. Everything else
# lives in its submodule; jax_comm_gemm.MOVED lists the names that moved.
TOP_LEVEL = [
    "CommGemmConfig", "all_gather_matmul", "autotune_step", "backends",
    "column_parallel_dense", "connect", "cublasmp_status", "cublasmp_version", "dense",
    "diagnostics", "fp8", "hlo", "linen", "matmul_reduce_scatter", "mlp", "nnx",
    "row_parallel_dense", "runtime", "sharded",
]
# The names the top level exported before and no longer does, and their homes.
MOVED = {"ALGORITHMS": "jax_comm_gemm.config", "Capability": "jax_comm_gemm.runtime",
         "REGISTRY": "jax_comm_gemm.runtime",
         **dict.fromkeys(["AutoBackend", "Backend", "CublasMpBackend", "TunedStep",
                          "XlaBackend", "autotune", "problems_of", "resolve_backend"],
                         "jax_comm_gemm.backends")}
REPO = PACKAGE.parent


def test_the_top_level_exports_exactly_the_curated_names():
  import jax_comm_gemm as jcg
  assert jcg.__all__ == TOP_LEVEL
  assert jcg.MOVED == MOVED


def test_the_curated_names_resolve_without_a_warning(recwarn):
  import jax_comm_gemm as jcg
  namespace = {}
  exec("from jax_comm_gemm import *", namespace)  # noqa: S102  (a fixed statement)
  assert set(TOP_LEVEL) <= set(namespace)
  assert all(getattr(jcg, name) is namespace[name] for name in TOP_LEVEL)
  assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)
              and "jax_comm_gemm" in str(w.message)]


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_warns_naming_its_home_and_is_the_same_object(name):
  import jax_comm_gemm as jcg
  home = importlib.import_module(MOVED[name])
  with pytest.warns(DeprecationWarning,
                    match=rf"^jax_comm_gemm\.{name} moved: import it from "
                          rf"{re.escape(MOVED[name])} \(from {re.escape(MOVED[name])} "
                          rf"import {name}\)"):
    value = getattr(jcg, name)
  assert value is getattr(home, name)


def test_dir_lists_the_curated_names_and_not_the_moved_ones():
  """IDEs complete from ``dir()``: it offers the curated names (the lazily
  imported submodules too) and hides the deprecated ones."""
  import jax_comm_gemm as jcg
  listed = dir(jcg)
  assert set(TOP_LEVEL) <= set(listed)
  assert not set(MOVED) & set(listed)


def test_an_unknown_name_is_an_attribute_error():
  import jax_comm_gemm as jcg
  with pytest.raises(AttributeError, match="'jax_comm_gemm' has no attribute 'nothing'"):
    jcg.nothing  # noqa: B018


def _moved_uses(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
  """Where `path` reaches a moved name through the top level: ``jcg.NAME`` in
  any text, ``from jax_comm_gemm import NAME`` in Python."""
  text = path.read_text()
  pattern = r"\bjcg\.(" + "|".join(MOVED) + r")\b"
  uses = [f"{path.relative_to(root)}: jcg.{m.group(1)}" for m in re.finditer(pattern, text)]
  if path.suffix == ".py":
    uses += [f"{path.relative_to(root)}: from jax_comm_gemm import {alias.name}"
             for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
             and node.module == "jax_comm_gemm" for alias in node.names
             if alias.name in MOVED]
  return uses


# Files that may name the moved names through the top level: this test, the
# package's __getattr__ (its example shows the warning), the changelog
# (history), and routes.py's two doctests until they read
# jcg.runtime.REGISTRY (pyproject's filterwarnings lets exactly that one warn).
MAY_USE_MOVED = {"tests/test_public_api.py", "jax_comm_gemm/__init__.py", "CHANGELOG.md"}


def test_the_repository_uses_the_new_homes():
  files = [p for folder in ("jax_comm_gemm", "tests", "examples", "benchmarks", "docs")
           for suffix in ("*.py", "*.md") for p in (REPO / folder).rglob(suffix)]
  files += [REPO / "README.md", REPO / "CHANGELOG.md"]
  uses = [use for p in files if str(p.relative_to(REPO)) not in MAY_USE_MOVED
          for use in _moved_uses(p)]
  assert not uses, "moved names used through the top level:\n" + "\n".join(uses)


def test_the_scan_sees_a_moved_name(tmp_path):
  planted = tmp_path / "planted.py"
  planted.write_text("import jax_comm_gemm as jcg\nfrom jax_comm_gemm import (connect,\n"
                     "    REGISTRY)\njcg.autotune_step\njcg.problems_of\n")
  assert _moved_uses(planted, tmp_path) == ["planted.py: jcg.problems_of",
                                  "planted.py: from jax_comm_gemm import REGISTRY"]
