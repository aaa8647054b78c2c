"""benchmarks/fp8_gemm.py runs on CPU in --smoke mode (tiny shapes, no torch,
no nvidia-smi) and writes its JSON and HLO dump."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "fp8_gemm.py"


def test_fp8_gemm_benchmark_smoke(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out, hlo = tmp_path / "fp8.json", tmp_path / "hlo.txt"
  proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out),
                         "--hlo", str(hlo)], capture_output=True, text=True, env=env,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads(out.read_text())
  assert result["meta"]["smoke"] and len(result["rows"]) == 2
  for row in result["rows"]:
    for name in ("jax_bf16", "fp8_direct", "fp8_cublaslt", "fp8_cublaslt_heuristic",
                 "fp8_cublaslt_row"):
      assert row[name] > 0
    assert max(row["fp8_rel_err_vs_bf16"].values()) < 0.1
  assert "| m x k x n |" in proc.stdout and "===== " in hlo.read_text()
  # summarize.py merges it into summary.json: every variant a row, with its precision.
  sys.path.insert(0, str(SCRIPT.parent))
  import summarize
  rows = summarize.summarize([str(out)])["rows"]
  by_variant = {r["variant"]: r["precision"] for r in rows if r["op"] == "gemm_one_gpu"}
  assert by_variant["jax_bf16"] == "bf16"
  assert by_variant["fp8_cublaslt"] == "fp8_tensor" and by_variant["fp8_cublaslt_row"] == "fp8_row"
  assert len(rows) == 2 * len(by_variant)
