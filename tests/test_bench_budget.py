"""benchmarks/bench.py's second pass: the shapes an op skipped for its share
of the budget run again with the time left, and their records replace the
"skipped" ones (GPU run 44 lost 9 cells while 98 s of its budget went unused);
and its memory part: which rows go first, and the workers' own autotune cache."""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench  # noqa: E402


def test_budget_skips_run_again_and_their_records_give_way():
  ag, rs, row = (SimpleNamespace(name=n) for n in ("all_gather_matmul", "matmul_reduce_scatter",
                                                   "row_parallel_fwd_bwd"))
  result = {"records": [
      {"op": ag.name, "shape": [8192, 4096, 4096], "variants": {"auto": {}}},
      {"op": ag.name, "shape": [2048, 8192, 8192], "skipped": "budget (needs ~20 s, 3 s left)"},
      {"op": rs.name, "shape": [4096, 4096, 4096], "skipped": "not implemented here"},
      {"op": row.name, "shape": [8192, 7168, 8192], "skipped": "budget (needs ~30 s, 0 s left)"},
      {"op": row.name, "shape": [4096, 16384, 4096], "skipped": "budget (needs ~30 s, 0 s left)"},
  ]}
  ran = []

  def run_op(spec):  # as Runner.run_op: runs what has no measured record
    ran.append(spec.name)
    done = {(r["op"], tuple(r["shape"])) for r in result["records"]}
    for shape in ([2048, 8192, 8192],) if spec is ag else ([8192, 7168, 8192], [4096, 16384, 4096]):
      if (spec.name, tuple(shape)) not in done:
        result["records"].append({"op": spec.name, "shape": shape, "variants": {"auto": {}}})

  bench.retry_budget_skips(result, [ag, rs, row], run_op)
  assert ran == [ag.name, row.name]  # the op skipped for another reason is left alone
  assert not [r for r in result["records"] if str(r.get("skipped", "")).startswith("budget")]
  measured = sorted((r["op"], tuple(r["shape"])) for r in result["records"] if "variants" in r)
  assert measured == sorted([(ag.name, (8192, 4096, 4096)), (ag.name, (2048, 8192, 8192)),
                             (row.name, (8192, 7168, 8192)), (row.name, (4096, 16384, 4096))])
  assert {"op": rs.name, "shape": [4096, 4096, 4096],
          "skipped": "not implemented here"} in result["records"]


def test_memory_rows_of_the_memory_target_come_first():
  """The variants the memory target compares run before the budget can end
  (GPU run 55 lost pure_jax's and xla's peaks)."""
  order = bench.memory_order(["pipelined_ce_all", "pipelined_ce", "ring", "auto", "xla",
                              "pure_jax", "auto_step", "floor"])
  assert order == ["auto", "pure_jax", "xla", "auto_step", "pipelined_ce_all", "pipelined_ce",
                   "ring", "floor"]


def test_memory_workers_get_a_private_copy_of_the_autotune_cache(tmp_path, monkeypatch):
  """The memory workers read the choices this process measured, and what they
  measure themselves (several at a time on the same GPUs) stays out of the
  cache later processes read (GPU runs 54 and 56)."""
  shared = tmp_path / "autotune.json"
  shared.write_text('{"sig": {"problem": ["pipelined_ce", "measured: ..."]}}')
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", str(shared))
  copy = bench.private_autotune_cache()
  try:
    assert copy != str(shared)
    with open(copy) as f:
      assert f.read() == shared.read_text()
  finally:
    os.remove(copy)
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", str(tmp_path / "none_yet.json"))
  copy = bench.private_autotune_cache()
  assert copy != str(tmp_path / "none_yet.json") and not os.path.exists(copy)
