"""The GPU suite's results as a checks x ranks table, from the workers' logs.

Usage: python tests/gpu/suite_table.py OUT.md RANKS=DIR [RANKS=DIR ...]
Each DIR holds one job's logs (JCG_GPU_LOG_DIR: multi_process_process*.log); a
rank count may come from several DIRs (a suite split over concurrent jobs).
Every cell is tests/gpu/outcome.py's verdict over that job's ranks: passed,
FAILED (any rank failed, or the ranks disagreed) or skipped (every rank, one
reason). Writes the table, each skip's reason, each failure's first lines, and
the details of the routing check (the row-parallel backward's all-gathers,
counted in the compiled HLO); prints one summary line per rank count.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tests.gpu.outcome import FAILED, PASSED, SKIPPED, outcome  # noqa: E402


def job_results(directory: str) -> dict[str, list[dict]]:
  """{check: [each process's result]} of one job's logs."""
  logs = sorted(glob.glob(os.path.join(directory, "multi_process_process*.log")),
                key=lambda p: int(re.search(r"process(\d+)\.log$", p).group(1)))
  per_process = []
  for path in logs:
    found = {}
    with open(path, errors="replace") as f:
      for line in f:
        if line.startswith("JCG_CHECK "):
          result = json.loads(line[len("JCG_CHECK "):])
          found[result.pop("name")] = result
    per_process.append(found)
  checks = sorted({name for found in per_process for name in found})
  return {name: [found.get(name, {"ok": False, "error": "this process reported nothing "
                                                        "(it hung or ended before)"})
                 for found in per_process] for name in checks}


def main(argv: list[str]) -> None:
  out, pairs = argv[0], [a.split("=", 1) for a in argv[1:]]
  by_ranks: dict[int, dict[str, list[dict]]] = {}
  for ranks, directory in pairs:
    by_ranks.setdefault(int(ranks), {}).update(job_results(directory))
  ranks = sorted(by_ranks)
  checks = sorted({c for results in by_ranks.values() for c in results})
  cells, notes, lines = {}, [], []
  for r in ranks:
    counts = {PASSED: 0, FAILED: 0, SKIPPED: 0}
    for check in checks:
      if check not in by_ranks[r]:
        cells[check, r] = "not run"
        continue
      status, why = outcome(by_ranks[r][check])
      counts[status] += 1
      cells[check, r] = {PASSED: "passed", FAILED: "**FAILED**", SKIPPED: "skipped"}[status]
      if status != PASSED:
        notes.append(f"- {check} at {r} ranks, {status}: {why.strip()[:600]}")
    lines.append(f"{r} ranks: {counts[PASSED]} passed, {counts[FAILED]} failed, "
                 f"{counts[SKIPPED]} skipped")
  table = ["| check | " + " | ".join(f"{r} ranks" for r in ranks) + " |",
           "| --- |" + " --- |" * len(ranks)]
  table += [f"| {c} | " + " | ".join(cells[c, r] for r in ranks) + " |" for c in checks]
  routing = []
  for r in ranks:
    results = by_ranks[r].get("routing", [])
    if results and results[0].get("details"):
      d = results[0]["details"]
      routing.append(f"- {r} ranks ({d.get('algorithm')}): row-parallel step fused "
                     f"{d.get('row_fused')}; forced XLA {d.get('row_fallback')}; "
                     f"{d.get('row_path')}")
  with open(out, "w") as f:
    f.write("\n".join(["## Checks x ranks", "", *lines, "", *table, "",
                       "## Routing (the row-parallel backward, counted in the compiled HLO)",
                       "", *routing, "", "## Skips and failures", "", *notes, ""]))
  print("\n".join(lines))


if __name__ == "__main__":
  main(sys.argv[1:])
