"""The package's shape: layers import downwards only, and files stay readable.

* No import cycle among the package's modules (imports inside functions count:
  a cycle dodged by a function-local import is still a cycle of the design).
* No module imports a package module inside a function.
* runtime/ imports nothing above it; backends/ nothing but runtime/ and
  the leaf helpers (vma).
* No file over 300 lines without a reason stated at its top.
"""

import ast
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
