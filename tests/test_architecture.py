"""The package's shape: layers import downwards only, and files stay readable.

* No import cycle among the package's modules (imports inside functions count:
  a cycle dodged by a function-local import is still a cycle of the design).
* No module imports a package module inside a function.
* runtime/ imports nothing above it; backends/ nothing but runtime/ and
  the leaf helpers (vma).
* No file over 300 lines without a reason stated at its top.
"""

import ast
import re
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_comm_gemm"
MAX_LINES = 300


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def _imports(name: str, path: pathlib.Path, modules) -> list[tuple[str, bool]]:
  """(imported package module, whether the import sits inside a function)."""
  package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  tree = ast.parse(path.read_text())
  inside = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      inside.update(id(n) for n in ast.walk(node) if n is not node)
  found = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      names = [base] + [f"{base}.{a.name}" for a in node.names]
    for imported in names:
      if imported in modules and imported not in (name, "jax_comm_gemm"):
        found.append((imported, id(node) in inside))
  return found


def _graph():
  modules = _modules()
  return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}

  def visit(node, stack):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if not state.get(nxt):
        cycle = visit(nxt, stack)
        if cycle:
          return cycle
    state[node] = 2
    stack.pop()
    return None

  for node in sorted(edges):
    if not state.get(node):
      cycle = visit(node, [])
      if cycle:
        return cycle
  return None


def test_cycle_finder_finds_a_planted_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
  _, graph = _graph()
  cycle = find_cycle({m: {i for i, _ in imports} for m, imports in graph.items()})
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_imports_inside_functions():
  _, graph = _graph()
  local = {m: [i for i, inside in imports if inside] for m, imports in graph.items()}
  assert not {m: i for m, i in local.items() if i}


@pytest.mark.parametrize("layer, forbidden", [
    ("jax_comm_gemm.runtime", ("backends", "layers", "flax", "collective_matmul",
                               "diagnostics", "config")),
    # The config and the checks sit below the backends: their defaults live there.
    ("jax_comm_gemm.config", ("backends", "layers", "flax", "collective_matmul",
                              "diagnostics")),
    ("jax_comm_gemm.validation", ("backends", "layers", "flax", "collective_matmul",
                                  "diagnostics", "config", "runtime")),
    ("jax_comm_gemm.backends", ("layers", "flax", "collective_matmul", "diagnostics")),
    ("jax_comm_gemm.layers", ("flax", "diagnostics")),
])
def test_layers_import_downwards(layer, forbidden):
  _, graph = _graph()
  bad = [(m, i) for m, imports in graph.items() if m.startswith(layer)
         for i, _ in imports
         if any(i.startswith(f"jax_comm_gemm.{f}") for f in forbidden)]
  assert not bad


def test_files_are_short_or_say_why():
  long = []
  for path in PACKAGE.rglob("*.py"):
    text = path.read_text()
    if text.count("\n") > MAX_LINES and "longer than 300 lines" not in text[:1500].lower():
      long.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines")
  assert not long


DESIGN = PACKAGE.parent / "docs" / "design.md"


def _listed_path() -> tuple[set[str], set[str]]:
  """The Python and the C++ files docs/design.md's "The path of one call" names."""
  text = DESIGN.read_text()
  section = text.split("\n## The path of one call\n", 1)[1].split("\n## ", 1)[0]
  files = set(re.findall(r"`((?:jax_comm_gemm|xla_ffi)/[\w/]+\.(?:py|cc))", section))
  return {f for f in files if f.endswith(".py")}, {f for f in files if f.endswith(".cc")}


def test_the_design_lists_the_files_one_call_runs_through(monkeypatch):
  """The Python files that a forward and backward of the linen dense layers run
  through on cuBLASMp's route (traced and lowered on a CPU, a stand-in
  extension) are those docs/design.md lists: a listed file no longer on the
  path fails, and so does a file on it that the list leaves out. The plan in
  force is read at the layers' entries alone. The C++ files exist."""
  from call_path import files_on_the_path
  from fake_native import install_fake_native

  python, cpp = _listed_path()
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  install_fake_native(monkeypatch)
  found, plan_reads = files_on_the_path()
  assert sorted(python - found) == [], "listed in docs/design.md but not on the path"
  assert sorted(found - python) == [], "on the path but not listed in docs/design.md"
  assert plan_reads == {("jax_comm_gemm/layers/dense.py", "column_global"),
                        ("jax_comm_gemm/layers/dense.py", "row_global")}
  assert cpp and all((PACKAGE.parent / f).is_file() for f in cpp), cpp


def test_the_plan_in_force_is_read_at_the_entries_alone():
  """``current_plan()`` (or ``REGISTRY.plan()`` outside runtime/) is called
  only in the entries a user calls (tests/plan_entries.py lists them); every
  function below takes the plan as an argument. A new read below an entry
  fails here; so does an entry that no longer reads it (the list stays true)."""
  from plan_entries import ENTRIES, plan_reads

  found = plan_reads()
  assert sorted(found - ENTRIES) == [], "reads the plan in force below an entry"
  assert sorted(ENTRIES - found) == [], "listed as an entry but reads no plan"
