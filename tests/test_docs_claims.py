"""The README's and docs' concrete claims, checked against the code: the
configuration and environment tables, the FP8 recipe table, the
troubleshooting reasons, the numbers the design quotes, and every file they
name. The audit these come from is the table in docs/contributing.md."""

import ast
import dataclasses
import inspect
import os
import pathlib
import re

import jax.numpy as jnp
import pytest

import jax_comm_gemm as jcg
from jax_comm_gemm.backends import routes, tuning
from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.runtime import peers, settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}


def table(text: str, header: str) -> dict[str, list[str]]:
  """The Markdown table whose header row starts with `header`: its rows by
  their first cell (backticks stripped), each the list of the other cells."""
  lines = text[text.index(f"| {header}"):].splitlines()
  rows = {}
  for line in lines[2:]:
    if not line.startswith("|"):
      break
    first, *rest = [cell.strip() for cell in line.strip("|").split(" | ")]
    rows[first.strip("`")] = rest
  return rows


def first_code(cell: str) -> str:
  """The first backticked value of a table cell."""
  return re.search(r"`([^`]*)`", cell).group(1)


def flat(text: str) -> str:
  return " ".join(text.split())


def test_the_configuration_table_is_commgemmconfig_with_its_defaults():
  rows = table(README, "`CommGemmConfig` field")
  fields = {f.name: f.default for f in dataclasses.fields(CommGemmConfig)}
  assert set(rows) == set(fields)
  assert {name: ast.literal_eval(first_code(cells[0])) for name, cells in rows.items()} == fields


SETTING_OF = {"BACKEND": "backend", "AUTOTUNE": "autotune", "AUTOTUNE_CACHE": "autotune_cache",
              "CONNECT_TIMEOUT": "connect_timeout_s", "TIMEOUT": "call_timeout_s",
              "ABORT_GRACE": "abort_grace_s", "ON_ABORT": "on_abort"}


def test_the_environment_table_is_every_variable_with_its_default(monkeypatch):
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  rows = table(README, "environment variable")
  assert set(rows) == set(settings.VARIABLES)
  defaults = settings.Settings.from_environ({})
  for name, cells in rows.items():
    field = SETTING_OF[name.removeprefix(settings.PREFIX)]
    said = "" if cells[0] == "unset" else first_code(cells[0])
    value = getattr(defaults, field)
    if isinstance(value, float):
      said = float(said)
    elif field == "autotune_cache":
      said = os.path.expanduser(said)
    assert said == value, name
  backends = re.findall(r"`(\w+)`", rows[settings.BACKEND][1].split(" overrides")[0])
  assert sorted(backends) == sorted(settings.BACKENDS)


def test_the_fp8_recipe_table_is_fp8recipe_with_its_defaults():
  rows = table(DOCS["fp8.md"], "field")
  recipe = Fp8Recipe()
  for name in ("scaling", "amax_history", "margin", "gemm_form", "accumulation", "casts"):
    said = rows[name][1].strip("`")
    assert ast.literal_eval(said) == getattr(recipe, name), name
  assert rows["forward_dtype` / `backward_dtype"][1] == "E4M3 / E5M2"
  assert (recipe.forward_dtype, recipe.backward_dtype) == (jnp.float8_e4m3fn, jnp.float8_e5m2)
  named = {name for row in rows for name in re.findall(r"\w+", row)}
  assert named == {f.name for f in dataclasses.fields(Fp8Recipe)}


def test_the_troubleshooting_reasons_are_what_the_code_says():
  reasons = list(table(README, "the reason says"))
  assert jcg.cublasmp_status().reason.startswith(reasons[0])  # on a CPU
  source = flat(" ".join(p.read_text() for p in (ROOT / "jax_comm_gemm").rglob("*.py")))
  for reason in reasons[1:]:
    text = reason.split(" (a warning")[0]
    pattern = re.escape(text).replace("'tp'", r"(?:'tp'|\{axis_name!r\})")
    assert re.search(pattern, source), reason


# (document, what it says, source file, the constant there as a regex)
NUMBERS = [
    ("README.md", "leads by more than 1%", "jax_comm_gemm/backends/tuning.py",
     r"KEEP_MARGIN = 0\.01\b"),
    ("design.md", "leads it by more than 1%", "jax_comm_gemm/backends/tuning.py",
     r"KEEP_MARGIN = 0\.01\b"),
    ("design.md", "XLA below 1e11 FLOP per GPU", "jax_comm_gemm/backends/routes.py",
     r"FUSED_FROM_FLOP = 1\.0e11\b"),
    ("design.md", "by more than 5% of XLA's largest value", "jax_comm_gemm/backends/tuning.py",
     r"AGREEMENT = 0\.05\b"),
    ("design.md", "polls the process's contexts every 0.25 s", "jax_comm_gemm/runtime/peers.py",
     r"POLL_S = 0\.25\b"),
    ("design.md", "Abort's 5 s grace", "xla_ffi/context.cc",
     r"kAbortGrace = std::chrono::seconds\(5\)"),
    ("design.md", "cuBLASLt's first 8 candidates", "xla_ffi/timed_pick.h",
     r"kTimedCandidates = 8;"),
    ("design.md", "at least 4e10 FLOP, two chunks down to 256 rows", "xla_ffi/pipelined.h",
     r"kMinChunkRows = 256;[\s\S]*kMinFourChunkBlockFlop = 4e10;"),
    ("design.md", "The workspace grows in 32 MiB steps", "xla_ffi/context.cc",
     r"kWorkspaceGranule = size_t\{32\} << 20;"),
]


@pytest.mark.parametrize("doc, says, path, constant", NUMBERS,
                         ids=[f"{d}:{s[-24:]}" for d, s, _, _ in NUMBERS])
def test_a_number_the_docs_quote_is_the_codes(doc, says, path, constant):
  text = README if doc == "README.md" else DOCS[doc]
  assert says in flat(text)
  assert re.search(constant, (ROOT / path).read_text())


def test_the_constants_the_numbers_name_are_in_force():
  assert (tuning.KEEP_MARGIN, routes.FUSED_FROM_FLOP, tuning.AGREEMENT, peers.POLL_S) == (
      0.01, 1e11, 0.05, 0.25)


def test_the_functions_the_readme_names_exist_as_it_calls_them():
  assert list(inspect.signature(report.layer_path).parameters)[:4] == [
      "config", "mesh", "axis_name", "dtype"]
  assert jcg.runtime.REGISTRY.contexts() == []
  assert callable(jcg.hlo.compiled_collectives)
  assert "rounds" in inspect.signature(jcg.autotune_step).parameters


def test_every_layer_function_and_module_takes_config_and_precision():
  """README, Configuration: "Every function and module takes config=...";
  "The layers and modules also take precision and keep_gathered_input"."""
  from jax_comm_gemm import linen, nnx
  functions = [jcg.all_gather_matmul, jcg.matmul_reduce_scatter, jcg.column_parallel_dense,
               jcg.row_parallel_dense, jcg.mlp, jcg.sharded.column_parallel_dense,
               jcg.sharded.row_parallel_dense, jcg.sharded.mlp]
  takes = [set(inspect.signature(f).parameters) for f in functions]
  takes += [{f.name for f in dataclasses.fields(getattr(linen, name))} for name in linen.__all__]
  takes += [set(inspect.signature(getattr(nnx, name).__init__).parameters)
            for name in nnx.__all__ if inspect.isclass(getattr(nnx, name))
            and name != "OverwriteWithGradient"]
  assert all({"config", "precision"} <= names for names in takes)
  gathering = [jcg.all_gather_matmul, jcg.column_parallel_dense, jcg.mlp,
               jcg.sharded.column_parallel_dense, jcg.sharded.mlp]
  assert all("keep_gathered_input" in inspect.signature(f).parameters for f in gathering)


def test_the_llama_options_the_llama_doc_quotes():
  """docs/llama.md: `epsilon` (1e-5), `use_bias` (False), `rope_base`."""
  from jax_comm_gemm.linen import SequenceParallelLlamaBlock
  defaults = {f.name: f.default for f in dataclasses.fields(SequenceParallelLlamaBlock)}
  assert (defaults["epsilon"], defaults["use_bias"], defaults["rope_base"]) == (1e-5, False,
                                                                                10000.0)
  doc = flat(DOCS["llama.md"])
  assert "`epsilon` (1e-5)" in doc and "`use_bias` (False;" in doc


def named_files(text: str, doc: pathlib.Path) -> list[str]:
  """The repository files `text` names: backticked paths and relative links."""
  paths = re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|cc|h|sh|md|toml|json))(?::[\w.]+)?`", text)
  links = [link for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
           if not link.startswith("http")]
  return [p for p in paths if not any(
      (base / p).exists() for base in (ROOT, ROOT / "jax_comm_gemm", doc.parent)
      ) and not list((ROOT / "benchmarks/results").glob(f"*/{p}"))] + [
      link for link in links if not (doc.parent / link).exists()]


def test_every_file_the_docs_name_exists():
  docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  missing = [f"{d.name}: {p}" for d in docs for p in named_files(d.read_text(), d)]
  assert not missing


def test_the_file_check_sees_a_missing_file():
  assert named_files("`jax_comm_gemm/gone.py` and [x](docs/gone.md)", ROOT / "README.md") == [
      "jax_comm_gemm/gone.py", "docs/gone.md"]
