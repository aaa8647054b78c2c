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


def test_the_same_program_timed_twice_gives_the_spread(tmp_path):
  """An auto cell that ran one implementation which the run also timed on its
  own: the table lists the pair and their difference (the run's resolution);
  a layer's plan of one implementation for every op pairs with its _all
  variant; auto cells that ran a mix pair with nothing."""
  step_xla = "step measured: all xla 2.914 ms, per-op choices 2.953 ms (all xla kept)"
  records = [
      {"op": "all_gather_matmul", "shape_str": "8192x8192x7168",
       "variants": {"auto": timed(1.277, autotune={AG: ["ring", "m"]}), "ring": timed(1.227),
                    "xla": timed(1.547), "floor": timed(1.0)}},
      {"op": "mlp_fwd_bwd", "shape_str": "4096x4096x16384",
       "variants": {"auto": timed(1.128, autotune={AG: ["ring", "m"], RS: ["pipelined_ce", "m"]}),
                    "auto_step": timed(1.126, autotune={AG: ["ring", "m"]},
                                       autotune_step=step_xla),
                    "xla": timed(1.104), "floor": timed(1.0)}},
      {"op": "row_parallel_fwd_bwd", "shape_str": "4096x16384x4096",
       "variants": {"auto_step": timed(1.094, autotune={RS: ["pipelined_ce", "m"]},
                                       autotune_step=STEP_WHY),
                    "pipelined_ce": timed(1.104), "pipelined_ce_all": timed(1.057),
                    "floor": timed(1.0)}}]
  (tmp_path / "project.json").write_text(json.dumps(
      {"part": "project", "schema": 1, "records": records, "finished": True}))
  summary = summarize.summarize([str(tmp_path)])
  pairs = summarize.same_program_pairs(summary["rows"])
  assert [(op, v, choice, twin) for op, _, v, choice, twin, *_ in pairs] == [
      ("all_gather_matmul", "auto", "ring", "ring"), ("mlp_fwd_bwd", "auto_step", "xla", "xla"),
      ("row_parallel_fwd_bwd", "auto_step", "pipelined_ce", "pipelined_ce_all")]
  table = summarize.markdown(summary)
  assert "| all_gather_matmul | 8192x8192x7168 | auto (ring) | 1.277 | ring 1.227 | 4.1% |" in table
  assert "| mlp_fwd_bwd | 4096x4096x16384 | auto_step (xla) | 1.126 | xla 1.104 | 2.0% |" in table
  assert "(median 3.5%, largest 4.1% over 3 pairs)" in table


def test_profile_lines_say_the_idle_inside_the_work_when_known(tmp_path):
  """The profiles' lines add the idle time between the device's first and
  last work where the trace summary has it (older JSON does not)."""
  device = {"busy_us": 900.0, "span_us": 1000.0, "overlap_2plus_us": 50.0, "idle_us": 100.0,
            "streams": {"a": {}, "b": {}}}
  profiles = [{"profile": "new", "step": {"devices": {"GPU0": dict(device, inner_idle_us=30.0)}}},
              {"profile": "old", "step": {"devices": {"GPU0": device}}}]
  (tmp_path / "project.json").write_text(json.dumps(
      {"part": "project", "schema": 1, "records": [], "profiles": profiles, "finished": True}))
  table = summarize.markdown(summarize.summarize([str(tmp_path)]))
  assert ("- new GPU0: busy 900 of 1000 us, ≥2 streams 50 us, idle 100 us (30 between its "
          "first and last work), 2 streams") in table
  assert "- old GPU0: busy 900 of 1000 us, ≥2 streams 50 us, idle 100 us, 2 streams" in table


def test_host_time_per_fused_call_has_its_own_table(tmp_path):
  """The records' host time per fused call reaches summary.json and a table of
  its own, variants in the table's order; variants without fused calls are left out."""
  record = {
      "op": "all_gather_matmul", "shape_str": "4096x4096x4096",
      "variants": {
          "pipelined_ce": timed(2.07, host_us_per_fused_call=96.4, fused_calls_per_iter=1.0),
          "auto": timed(2.04, host_us_per_fused_call=85.6, fused_calls_per_iter=1.0),
          "xla": timed(2.05), "floor": timed(1.0)}}
  (tmp_path / "project.json").write_text(json.dumps(
      {"part": "project", "schema": 1, "records": [record], "finished": True}))
  summary = summarize.summarize([str(tmp_path)])
  by_variant = {r["variant"]: r for r in summary["rows"]}
  assert by_variant["auto"]["host_us_per_fused_call"] == 85.6
  assert "host_us_per_fused_call" not in by_variant["xla"]
  table = summarize.markdown(summary)
  assert "## Host time per fused call" in table
  assert "| all_gather_matmul | 4096x4096x4096 | auto: 86 (1), pipelined_ce: 96 (1) |" in table
