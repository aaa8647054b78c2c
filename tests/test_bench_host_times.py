"""benchmarks/bench.py's host time per fused call: each timed batch's share of
the contexts' counters goes to the variant that ran it, and the record says
how much host time one fused call took and how many a step made."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench  # noqa: E402

from jax_comm_gemm.runtime.registry import CallCounters  # noqa: E402


def test_each_batch_is_charged_to_the_variant_that_ran_it():
  # Two contexts (one process, two GPUs): a batch of 10 iterations of "fused"
  # makes 3 fused calls an iteration on each, 80 us each; "xla" makes none.
  counters = {"calls": 0, "seconds": 0.0}

  def read():
    return CallCounters(counters["calls"], counters["seconds"], 2)

  def run(variant, iters=10):
    if variant == "fused":
      counters["calls"] += 2 * 3 * iters
      counters["seconds"] += 2 * 3 * iters * 80e-6

  host = bench.HostTimes(read)
  counters["calls"], counters["seconds"] = 500, 1.0  # calls before the timed rounds
  for order in (["fused", "xla"], ["xla", "fused"]):  # two rounds, alternating
    for variant in order:
      host.mark(variant)
      run(variant)
  host.mark(None)  # the end of the last batch
  run("fused")  # after it, charged to no one
  got = host.entry("fused", batches=2, iters=10)
  assert got["fused_calls_per_iter"] == 3
  assert abs(got["host_us_per_fused_call"] - 80.0) < 1e-6
  assert host.entry("xla", batches=2, iters=10) == {}


def test_the_record_line_shows_host_time_only_where_there_is_one():
  rec = {"op": "all_gather_matmul", "shape_str": "4096x4096x4096", "elapsed_s": 3.0,
         "variants": {"auto": {"median_ms": 0.2, "over_floor": 2.0,
                               "host_us_per_fused_call": 85.6, "fused_calls_per_iter": 1.0},
                      "xla": {"median_ms": 0.2, "over_floor": 2.05}}}
  line = bench.line_for(rec)
  assert "host us a fused call x calls an iteration: auto 86x1 |" in line
  del rec["variants"]["auto"]["host_us_per_fused_call"]
  assert "host us" not in bench.line_for(rec)
