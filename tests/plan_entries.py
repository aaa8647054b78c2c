"""Where the package may read the routing plan in force (``current_plan()``):
the entries a user calls, each of which reads it once and passes it down. Below
them every function takes the plan as an argument. ``tests/test_architecture.py``
holds the source to this list; ``tests/test_plan_argument.py`` holds a run to it."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_comm_gemm"

# (file, function): the public entries that read the plan in force.
ENTRIES = frozenset({
    # The public functional ops.
    ("jax_comm_gemm/collective_matmul.py", "all_gather_matmul"),
    ("jax_comm_gemm/collective_matmul.py", "matmul_reduce_scatter"),
    # The layers' entries: the public local and global functions, and the
    # checked entries that flax/common.run calls by name.
    ("jax_comm_gemm/layers/dense.py", "mlp"),
    ("jax_comm_gemm/layers/dense.py", "sharded_mlp"),
    ("jax_comm_gemm/layers/dense.py", "column_local"),
    ("jax_comm_gemm/layers/dense.py", "row_local"),
    ("jax_comm_gemm/layers/dense.py", "column_global"),
    ("jax_comm_gemm/layers/dense.py", "row_global"),
    ("jax_comm_gemm/layers/gated_mlp.py", "gated_mlp"),
    ("jax_comm_gemm/layers/transformer.py", "block_local"),
    ("jax_comm_gemm/layers/transformer.py", "block_global"),
    ("jax_comm_gemm/layers/llama.py", "block_local"),
    ("jax_comm_gemm/layers/llama.py", "block_global"),
    # The user's questions and tuners: which backend a config takes
    # (jcg.backends.resolve_backend), the tuners, the report.
    ("jax_comm_gemm/backends/routes.py", "choose_backend"),
    ("jax_comm_gemm/backends/tuning.py", "problems_of"),
    ("jax_comm_gemm/backends/tuning.py", "autotune"),
    ("jax_comm_gemm/backends/tuning.py", "autotune_step"),
    ("jax_comm_gemm/diagnostics/report.py", "layer_path"),
})


def plan_reads() -> set[tuple[str, str]]:
  """(file, enclosing function) of each call of ``current_plan`` in the
  package's source, and of ``REGISTRY.plan()`` outside runtime/ (the same read
  by another name). Docstrings are not calls."""
  found = set()
  for path in sorted(PACKAGE.rglob("*.py")):
    name = str(path.relative_to(PACKAGE.parent))
    runtime = name.startswith("jax_comm_gemm/runtime/")

    def visit(node, function):
      for child in ast.iter_child_nodes(node):
        inner = (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                 else function)
        if isinstance(child, ast.Call) and _reads(child.func, runtime):
          found.add((name, function))
        visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
  return found


def _reads(func, runtime: bool) -> bool:
  if isinstance(func, ast.Name):
    return func.id == "current_plan"
  if isinstance(func, ast.Attribute):
    if func.attr == "current_plan":
      return True
    return (not runtime and func.attr == "plan" and isinstance(func.value, ast.Name)
            and func.value.id == "REGISTRY")
  return False
