"""examples/train_sp_mlp.py, run as a user would: the loss falls, the report is
printed, and the compiled training step holds the all-gathers the design expects;
and jax_comm_gemm.report, which states those expectations, for every backend.

The runs are pinned to the CPU (8 simulated devices, mesh dp=4 x tp=2), where
the layers take the XLA fallback. Per SP-MLP block and training step that is 2
all-gathers: fc1's forward gather and fc2's dgrad gather (whose result fc2's
weight gradient reuses). fc1's backward gathers its input again for the weight
gradient, but that all-gather is the forward's op on the same operand, so XLA's
CSE merges the two; with --keep-gathered-input the backward takes the forward's
result directly. Either way 2 per block, as plain autodiff of
shard_map(all_gather -> dot) gives. Reduce-scatters: fc2's forward and fc1's
dgrad, 2 per block (block0's dgrad feeds its LayerNorm's gradient, so none is
dead).
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from conftest import cpu_mesh
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.backends import Capability, CublasMpBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_sp_mlp.py"


def run_example(tmp_path, *flags):
  out = tmp_path / "summary.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")])))
  env.pop("JAX_COMM_GEMM_BACKEND", None)
  proc = subprocess.run([sys.executable, str(EXAMPLE), "--json-out", str(out), *flags],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout, json.loads(out.read_text())


def check_xla_fallback_run(stdout, summary, layers):
  # The loss falls well within a few dozen steps (about 0.25x on this task).
  assert summary["last_loss"] < 0.7 * summary["first_loss"], summary["losses"]
  assert summary["tokens_per_s"] > 0
  assert summary["mesh"] == {"dp": 4, "tp": 2}
  for line in ("loss: first", "layers (backend 'auto', tp=2",
               "collectives per training step", "standalone all-gathers",
               "fused AllGather+GEMM calls"):
    assert line in stdout
  for i in range(layers):
    assert re.search(rf"block{i}: fc1 \(column-parallel\): xla fallback +"
                     r"fc2 \(row-parallel\): xla fallback", stdout), stdout
  assert "MISMATCH" not in stdout
  assert summary["paths"] == [{"block": i, "fc1": "xla fallback", "fc2": "xla fallback"}
                              for i in range(layers)]
  counts = summary["counts"]
  assert counts["standalone_all_gathers"] == 2 * layers
  assert counts["fused_all_gather_matmuls"] == 0
  assert counts["reduce_scatters"] == 2 * layers
  assert counts["fused_matmul_reduce_scatters"] == 0
  assert summary["expected"] == {"standalone_all_gathers": 2 * layers,
                                 "fused_all_gather_matmuls": 0}


@pytest.mark.parametrize("flags, layers", [
    (("--steps", "30"), 4),
    (("--steps", "30", "--layers", "3", "--keep-gathered-input", "--dtype", "bfloat16"), 3),
], ids=["float32", "keep-bfloat16"])
def test_train_sp_mlp(tmp_path, flags, layers):
  stdout, summary = run_example(tmp_path, *flags)
  check_xla_fallback_run(stdout, summary, layers)
  assert len(summary["losses"]) == 30
  assert summary["args"]["keep_gathered_input"] == ("--keep-gathered-input" in flags)


@dataclasses.dataclass(frozen=True)
class _FakeCublasMp(CublasMpBackend):
  """The cuBLASMp backend as the report sees it, with a chosen reuse verdict."""
  reuse_ok: bool = True

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    return Capability(self.reuse_ok, "fake verdict")


@pytest.mark.parametrize("backend, reuse_gathered, axis_size, column, keep, row, counts", [
    # The design's table: MLP 2 -> 1 standalone all-gathers with reuse, 0 with keep.
    (_FakeCublasMp(reuse_ok=True), None, 2, "fused with all_gather", "fused with reuse",
     "fused with reuse", ((1, 2), (0, 2))),
    (_FakeCublasMp(reuse_ok=False), None, 2, "fused with all_gather", "fused with all_gather",
     "fused with all_gather", ((2, 2), (2, 2))),
    (_FakeCublasMp(reuse_ok=True), False, 4, "fused with all_gather", "fused with all_gather",
     "fused with all_gather", ((2, 2), (2, 2))),
    (_FakeCublasMp(reuse_ok=True), None, 1, "xla fallback", "xla fallback", "xla fallback",
     ((2, 0), (2, 0))),
    ("xla", None, 2, "xla fallback", "xla fallback", "xla fallback", ((2, 0), (2, 0))),
])
def test_report(monkeypatch, backend, reuse_gathered, axis_size, column, keep, row, counts):
  monkeypatch.delenv("JAX_COMM_GEMM_BACKEND", raising=False)
  config = CommGemmConfig(backend=backend, reuse_gathered=reuse_gathered)
  mesh = cpu_mesh(axis_size)
  path = lambda **kw: report.layer_path(config, mesh, "tp", jnp.bfloat16, **kw).path
  assert (path(), path(keep_gathered_input=True), path(reduce_scatter_layer=True)) == (
      column, keep, row)
  expected = lambda keep: dataclasses.astuple(report.expected_all_gathers(
      config, mesh, "tp", jnp.bfloat16, keep_gathered_input=keep))
  assert (expected(False), expected(True)) == counts
