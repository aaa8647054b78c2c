"""benchmarks/summarize.py on a tiny project part: each auto cell of the table
says what it ran (autotune's choices, or autotune_step's plan)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import summarize  # noqa: E402

AG = "all_gather_matmul rows=4096 k=8192 m=3584 bfloat16 NN P=2"
RS = "matmul_reduce_scatter rows=8192 k=3584 m=8192 bfloat16 NN P=2"
STEP_WHY = ("step measured: all pipelined_ce 5.057 ms, per-op choices 5.138 ms, all xla "
            "5.419 ms (all pipelined_ce kept)")


def timed(ratio, **extra):
  return {"median_ms": ratio, "over_floor": ratio, **extra}


def test_auto_cells_say_what_ran(tmp_path):
  record = {
      "op": "mlp_fwd_bwd", "shape_str": "8192x8192x7168",
      "variants": {
          "auto": timed(1.186, autotune={AG: ["ring", "measured"], RS: ["pipelined_ce", "m"]}),
          "auto_step": timed(1.175, autotune={AG: ["ring", "m"]}, autotune_step=STEP_WHY),
          "xla": timed(1.219), "floor": timed(1.0)}}
  (tmp_path / "project.json").write_text(json.dumps(
      {"part": "project", "schema": 1, "records": [record], "finished": True}))
  summary = summarize.summarize([str(tmp_path)])
  rows = summary["rows"]
  ran = {r["variant"]: r.get("choice") for r in rows}
  assert ran == {"auto": "pipelined_ce+ring", "auto_step": "pipelined_ce", "xla": None,
                 "floor": None}
  table = summarize.markdown(summary)
  assert "| 8192x8192x7168 | 1.186 (1.186) pipelined_ce+ring | **1.175** (1.175) pipelined_ce |" \
      in table


def test_step_plans_read_from_autotune_steps_words():
  assert summarize.choice_of({"autotune_step": "step measured: ... (per-op choices kept)"}) \
      == "per-op"
  assert summarize.choice_of(
      {"autotune_step": "step measured: ... (XLA kept: a lead under 1% is noise)"}) == "xla"
  assert summarize.choice_of(
      {"autotune_step": "step measured: ... (all pipelined_ce kept) (cached)"}) == "pipelined_ce"
  assert summarize.choice_of({"autotune": {}}) is None
