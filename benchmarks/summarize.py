#!/usr/bin/env python3
"""Merges the benchmark parts' JSON (bench.py, its windowed-einsum mode, the
peers) into summary.json, table.md and plot.png. Needs only json and
matplotlib (no GPU, no jax): run it anywhere on the JSON that came back.

  python3 benchmarks/summarize.py PART.json|DIR ... --out-dir DIR [--brief]

summary.json: {"rows": [{"op", "shape", "variant", "precision", "median_ms",
  "over_floor", "part", "floor_ms", ...}, {"op": "mlp_step_memory", "shape", "variant",
  "temp_mib", "peak_mib", ...}, ...], "machine", "versions", "clocks",
  "profiles", "parts"}. over_floor is the median over rounds of the variant's
  time over the floor's in the same round of the same process (each peer with
  its own floor, whose median is the row's floor_ms). A variant that failed has
  "error" (and no times); one the budget left out has "skipped".

Longer than 300 lines because the JSON merge, the Markdown table and the plot read the same rows; one file keeps their names in one place.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

OP_TITLES = {
    "all_gather_matmul": "AllGather+GEMM, n × k × m",
    "all_gather_matmul_sweep": "AllGather+GEMM over tokens, n × 8192 × 8192",
    "matmul_reduce_scatter": "GEMM+ReduceScatter, n × k × m (k split)",
    "row_parallel_fwd_bwd": "Row-parallel layer, forward + backward, tokens × F × K",
    "mlp_fwd_bwd": "SP MLP, forward + backward, tokens × d × ffn",
    "transformer_fwd_bwd": "Transformer block, forward + backward",
    "mlp_step_memory": "SP MLP step memory (MiB): compiled temp / peak of XLA's allocator",
    "gemm_one_gpu": "One GPU's GEMM, m × k × n, bf16 and FP8 (benchmarks/fp8_gemm.py)",
}
OP_ORDER = list(OP_TITLES)
VARIANT_ORDER = [
    "auto", "auto_fused", "auto_copy", "auto_no_reuse", "auto_keep", "auto_step",
    "cublasmp_split_p2p", "cublasmp_split_p2p_fused", "cublasmp_split_p2p_copy",
    "cublasmp_default",
    "pipelined", "pipelined_ce", "pipelined_ce_fused", "pipelined_ce_copy", "ring",
    "cublasmp_rs_default", "cublasmp_rs_ring", "cublasmp_rs_pipelined_ce",
    "pipelined_ce_all", "pipelined_ce_all_fused", "pipelined_ce_all_copy",
    "xla",
    "pure_jax", "windowed_einsum", "torch_symm_mem", "torch_nccl", "pallas_mgpu", "floor",
    "jax_bf16", "fp8_direct", "fp8_cublaslt", "fp8_cublaslt_heuristic", "torch_scaled_mm",
    "fp8_cublaslt_row", "torch_scaled_mm_row",
]
PART_MAIN_VARIANT = {"windowed_einsum": "windowed_einsum", "torch_symm_mem": "torch_symm_mem",
                     "pallas_mgpu": "pallas_mgpu", "project": "*"}


def load_parts(paths):
  parts = []
  for path in paths:
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    for f in files:
      if os.path.basename(f) == "summary.json":
        continue
      try:
        with open(f) as fh:
          data = json.load(fh)
      except Exception as e:  # noqa: BLE001
        print(f"skipping {f}: {e}", file=sys.stderr)
        continue
      if isinstance(data, dict) and "parts" in data and isinstance(data["parts"], list):
        parts += [p for p in data["parts"] if isinstance(p, dict)]
      elif isinstance(data, dict) and ("records" in data or "part" in data):
        data.setdefault("_file", f)
        parts.append(data)
  return parts


def mean_of(state, key):
  vals = [s.get(key) for s in state or [] if isinstance(s.get(key), (int, float))]
  return round(statistics.mean(vals), 1) if vals else None


def build_rows(parts):
  rows, clocks = {}, []
  project_floor = set()
  for part in parts:
    if part.get("part") == "project":
      for r in part.get("records", []):
        if "floor" in r.get("variants", {}) and "median_ms" in r["variants"]["floor"]:
          project_floor.add((r["op"], r["shape_str"]))
  floors_taken = set(project_floor)
  for part in parts:
    name = part.get("part", "?")
    if part.get("error") and not part.get("records"):
      rows[("*", None, name)] = {"op": "*", "shape": None, "variant": name, "part": name,
                                 "median_ms": None, "over_floor": None,
                                 "error": str(part["error"])[:400]}
    for h in part.get("hangs") or []:  # a shape that hung and was not measured after
      if h.get("op") and h.get("shape"):
        v = h.get("variant") or PART_MAIN_VARIANT.get(name, name)
        rows.setdefault((h["op"], h["shape"], v), {
            "op": h["op"], "shape": h["shape"], "variant": v, "part": name, "median_ms": None,
            "over_floor": None, "error": f"hung: {h.get('what') or h.get('phase')}"})
    for r in part.get("records", []):
      op, shape = r.get("op"), r.get("shape_str")
      if "variants" not in r:
        v = PART_MAIN_VARIANT.get(name, name)
        rows[(op, shape, v)] = {"op": op, "shape": shape, "variant": v, "part": name,
                                "median_ms": None, "over_floor": None,
                                **({"skipped": r["skipped"]} if "skipped" in r else
                                   {"error": str(r.get("error", "?"))[:400]})}
        continue
      end = r.get("gpu_state_end", [])
      clk = {"part": name, "op": op, "shape": shape,
             "end_sm_mhz": mean_of(end, "clock_sm_mhz"), "end_power_w": mean_of(end, "power_w"),
             "warm_sm_mhz": mean_of(r.get("gpu_state_warm"), "clock_sm_mhz"),
             "warm_power_w": mean_of(r.get("gpu_state_warm"), "power_w"),
             "temp_c": mean_of(end, "temp_c")}
      if not r.get("copied_from"):
        clocks.append(clk)
      floor_ms = r["variants"].get("floor", {}).get("median_ms")
      for v, e in r["variants"].items():
        if v == "floor":
          if (op, shape) in floors_taken and name != "project":
            continue
          floors_taken.add((op, shape))
        row = {"op": op, "shape": shape, "variant": v, "part": name,
               "median_ms": e.get("median_ms"), "over_floor": e.get("over_floor"),
               "floor_ms": floor_ms, "sm_mhz": clk["end_sm_mhz"], "power_w": clk["end_power_w"]}
        row["precision"] = e.get("precision", "bf16")
        for key in ("rel_err", "iters", "temp_mib", "compile_s", "hlo",
                    "host_us_per_fused_call", "fused_calls_per_iter"):
          if key in e:
            row[key] = e[key]
        if "error" in e:
          row["error"] = str(e["error"])[:400]
        if r.get("best_config") and v == "pallas_mgpu":
          row["config"] = r["best_config"]
        if choice := choice_of(e):
          row["choice"] = choice
        if "error" in r and "median_ms" not in e:
          row.setdefault("error", str(r["error"])[:400])
        rows[(op, shape, v)] = row
    if name == "project":  # compiled temp bytes from the timing run, where no worker ran
      for r in part.get("records", []):
        if r.get("op") != "mlp_fwd_bwd" or "variants" not in r:
          continue
        for v, e in r["variants"].items():
          key = ("mlp_step_memory", r["shape_str"], v)
          if e.get("temp_mib") is not None and key not in rows:
            rows[key] = {"op": "mlp_step_memory", "shape": r["shape_str"], "variant": v,
                         "temp_mib": e["temp_mib"], "peak_mib": None, "part": name,
                         "note": "temp from the timing run; no peak measured"}
    for m in part.get("memory", []):
      row = {"op": "mlp_step_memory", "shape": m.get("shape_str"), "variant": m.get("variant"),
             "temp_mib": m.get("temp_mib"), "peak_mib": m.get("peak_mib"), "part": name}
      for key in ("proc_gpu_mib", "note", "error", "skipped", "arg_mib", "out_mib"):
        if m.get(key) is not None:
          row[key] = m[key]
      key = ("mlp_step_memory", row["shape"], row["variant"])
      if row.get("temp_mib") is None and key in rows:
        rows[key].setdefault("note", row.get("error") or row.get("skipped"))
        continue  # keep the timing run's temp bytes
      rows[key] = row
  return list(rows.values()), clocks


def choice_of(entry: dict) -> str | None:
  """What an auto variant ran: autotune_step's plan ("per-op" for the per-op
  choices), else the implementations autotune chose for its problems."""
  found = re.search(r"\(([^()]*) kept[:)]", entry.get("autotune_step") or "")
  if found:  # "(all pipelined_ce kept)", "(per-op choices kept)", "(XLA kept: ...)"
    kept = found.group(1)
    return {"per-op choices": "per-op", "XLA": "xla"}.get(kept, kept.removeprefix("all "))
  choices = entry.get("autotune")
  if isinstance(choices, dict) and choices:
    return "+".join(sorted({c[0] for c in choices.values()}))
  return None


# Layer ops: an auto variant that ran one implementation for every op ran the
# program of this variant.
LAYER_TWINS = {"xla": "xla", "ring": "ring", "pipelined_ce": "pipelined_ce_all"}
LAYER_OPS = ("row_parallel_fwd_bwd", "mlp_fwd_bwd", "transformer_fwd_bwd")


def same_program_pairs(rows):
  """(op, shape, auto variant, what it ran, the variant that ran the same
  program, their over_floor values): where an auto variant ran one
  implementation that the run also timed as a variant of its own. Their
  difference is the measurement's spread for that cell, the resolution
  below which two cells of the run do not differ."""
  cell = {(r["op"], r["shape"], r["variant"]): r for r in rows}
  pairs, seen = [], set()
  for r in rows:
    choice = r.get("choice")
    if not r["variant"].startswith("auto") or not choice or r.get("over_floor") is None:
      continue
    # A mix of implementations ("a+b") names no variant, so it pairs with none.
    twin = LAYER_TWINS.get(choice) if r["op"] in LAYER_OPS else choice
    other = cell.get((r["op"], r["shape"], twin))
    if other is None or other.get("over_floor") is None:
      continue
    # The sweep repeats the AllGather+GEMM's shapes as copies: one pair each.
    key = (r["shape"], r["variant"], twin, r["over_floor"], other["over_floor"])
    if key not in seen:
      seen.add(key)
      pairs.append((r["op"], r["shape"], r["variant"], choice, twin, r["over_floor"],
                    other["over_floor"]))
  return pairs


def shape_key(shape):
  try:
    return tuple(int(v) for v in shape.split("x"))
  except Exception:  # noqa: BLE001
    return (0,)


def ordered(rows, op):
  """Shapes in the order the runs listed them; variants in VARIANT_ORDER."""
  shapes, variants = [], []
  for r in rows:
    if r["op"] == op:
      if r["shape"] not in shapes and r["shape"] is not None:
        shapes.append(r["shape"])
      if r["variant"] not in variants and r["variant"] != "*":
        variants.append(r["variant"])
  if op == "all_gather_matmul_sweep":
    shapes.sort(key=shape_key)
  rank = {v: i for i, v in enumerate(VARIANT_ORDER)}
  variants.sort(key=lambda v: (rank.get(v, len(rank)), v))
  return shapes, variants


def fmt(v, digits=3):
  return "–" if v is None else f"{v:.{digits}f}"


def fmt_mib(v):
  return "–" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.2g}")


def markdown(summary):
  rows = summary["rows"]
  out = ["# Benchmark summary", ""]
  m = summary.get("machine", {})
  if m:
    out.append(f"Machine: {', '.join(m.get('gpus', []) or ['?'])}; {m.get('date_utc', '')}; "
               f"host {m.get('host', '?')}")
  for part, ver in summary.get("versions", {}).items():
    out.append(f"- {part}: " + ", ".join(f"{k} {v}" for k, v in ver.items() if v is not None))
  out += ["", "Cells: time over the GEMM-only floor, median of per-round ratios in the same "
          "run (lower is better; **bold**: best per shape), then the median ms per call, "
          "and for auto variants what they ran (autotune's choices, or autotune_step's plan). "
          "Peers are timed against their own floor, in their own processes.", ""]
  ops = [o for o in OP_ORDER if any(r["op"] == o for r in rows)] + sorted(
      {r["op"] for r in rows if r["op"] not in OP_ORDER and r["op"] != "*"})
  for op in ops:
    shapes, variants = ordered(rows, op)
    if not shapes:
      continue
    out += [f"## {OP_TITLES.get(op, op)}", ""]
    if not [v for v in variants if v != "floor"]:
      why = {str(r.get("skipped") or r.get("error")) for r in rows if r["op"] == op}
      out += ["Not measured: " + "; ".join(sorted(why))[:400], ""]
      continue
    cell = {(r["shape"], r["variant"]): r for r in rows if r["op"] == op}
    notes = []
    if op == "mlp_step_memory":
      out.append("| shape | " + " | ".join(variants) + " |")
      out.append("| --- |" + " --- |" * len(variants))
      for s in shapes:
        cells = []
        for v in variants:
          r = cell.get((s, v))
          if r is None:
            cells.append("")
          elif "error" in r or "skipped" in r:
            cells.append("err" if "error" in r else "–")
            if "error" in r:
              notes.append(f"{v} @ {s}: {r['error'][:200]}")
          else:
            cells.append(f"{fmt_mib(r.get('temp_mib'))} / {fmt_mib(r.get('peak_mib'))}")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    else:
      timed = [v for v in variants if v != "floor"]
      out.append("| shape | " + " | ".join(timed) + " | floor ms | SM MHz / W |")
      out.append("| --- |" + " --- |" * (len(timed) + 2))
      for s in shapes:
        vals = {v: cell[(s, v)].get("over_floor") for v in timed
                if (s, v) in cell and cell[(s, v)].get("over_floor") is not None}
        best = min(vals.values()) if vals else None
        cells = []
        for v in timed:
          r = cell.get((s, v))
          if r is None:
            cells.append("")
          elif r.get("over_floor") is None and r.get("median_ms") is None:
            cells.append("–" if "skipped" in r else "err")
            if "error" in r:
              notes.append(f"{v} @ {s}: {r['error'][:200]}")
          else:
            of = fmt(r.get("over_floor"))
            of = f"**{of}**" if r.get("over_floor") == best else of
            ran = f" {r['choice']}" if r.get("choice") else ""
            cells.append(f"{of} ({fmt(r.get('median_ms'))}){ran}")
        fl = cell.get((s, "floor"), {})
        out.append(f"| {s} | " + " | ".join(cells)
                   + f" | {fmt(fl.get('median_ms'))} | {fmt(fl.get('sm_mhz'), 0)} / "
                     f"{fmt(fl.get('power_w'), 0)} |")
    if notes:
      out += ["", "Errors: " + "; ".join(notes[:12]) + (" …" if len(notes) > 12 else "")]
    out.append("")
  pairs = same_program_pairs(rows)
  if pairs:
    gaps = [abs(a / b - 1) * 100 for *_, a, b in pairs]
    out += ["## The same program twice", "",
            "Where an auto variant ran one implementation that the run also timed on its own, "
            "the two cells time one program: their difference is the run's spread there "
            f"(median {statistics.median(gaps):.1f}%, largest {max(gaps):.1f}% over "
            f"{len(pairs)} pairs). A gap between cells smaller than that is not resolved.", "",
            "| op | shape | auto variant (ran) | its cell | the twin's cell | difference |",
            "| --- | --- | --- | --- | --- | --- |"]
    for (op, shape, variant, choice, twin, a, b), gap in zip(pairs, gaps):
      out.append(f"| {op} | {shape} | {variant} ({choice}) | {a:.3f} | {twin} {b:.3f} | "
                 f"{gap:.1f}% |")
    out.append("")
  host = [r for r in rows if r.get("host_us_per_fused_call") is not None]
  if host:
    out += ["## Host time per fused call", "",
            "µs of host time a fused call took on one GPU's context (from taking the "
            "context's lock to its last enqueue, over the timed rounds), and the fused calls "
            "an iteration made. Where it is near a call's GPU time, back-to-back calls are "
            "bound by the host (docs/performance.md).", "",
            "| op | shape | variant: µs a call (calls an iteration) |", "| --- | --- | --- |"]
    cell = {(r["op"], r["shape"], r["variant"]): r for r in host}
    for op in dict.fromkeys(r["op"] for r in host):
      shapes, variants = ordered(host, op)
      for shape in shapes:
        cells = [f"{v}: {cell[op, shape, v]['host_us_per_fused_call']:.0f} "
                 f"({cell[op, shape, v]['fused_calls_per_iter']:g})"
                 for v in variants if (op, shape, v) in cell]
        out.append(f"| {op} | {shape} | " + ", ".join(cells) + " |")
    out.append("")
  failed = [r for r in rows if r["op"] == "*"]
  if failed:
    out += ["## Parts that failed", ""] + [f"- {r['variant']}: {r.get('error')}" for r in failed]
    out.append("")
  profs = summary.get("profiles", [])
  if profs:
    out += ["## Profiles (one step)", ""]
    for p in profs:
      if p.get("error"):
        out.append(f"- {p['profile']}: error {p['error'][:200]}")
        continue
      for dev, d in (p.get("step") or {}).get("devices", {}).items():
        inside = (f" ({d['inner_idle_us']:.0f} between its first and last work)"
                  if "inner_idle_us" in d else "")
        out.append(f"- {p['profile']} {dev}: busy {d['busy_us']:.0f} of {d['span_us']:.0f} us, "
                   f"≥2 streams {d['overlap_2plus_us']:.0f} us, idle {d['idle_us']:.0f} us"
                   f"{inside}, {len(d.get('streams', {}))} streams")
    out.append("")
  return "\n".join(out)


def plot(summary, path):
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except Exception as e:  # noqa: BLE001
    print(f"no plot ({e}); pip install matplotlib", file=sys.stderr)
    return False
  rows = [r for r in summary["rows"] if r.get("over_floor") is not None]
  ops = [o for o in OP_ORDER if any(r["op"] == o for r in rows)] + sorted(
      {r["op"] for r in rows if r["op"] not in OP_ORDER})
  if not ops:
    print("no timed rows to plot", file=sys.stderr)
    return False
  ncols = 2 if len(ops) > 1 else 1
  nrows = (len(ops) + ncols - 1) // ncols
  fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 4.2 * nrows), squeeze=False)
  present = [v for v in VARIANT_ORDER if any(r["variant"] == v for r in rows)] + sorted(
      {r["variant"] for r in rows if r["variant"] not in VARIANT_ORDER})
  palette = [plt.get_cmap("tab10")(i) for i in range(10)] + [
      plt.get_cmap("Dark2")(i) for i in range(8)]
  colors = {v: palette[i % len(palette)] for i, v in enumerate(p for p in present if p != "floor")}
  colors["floor"] = "0.5"
  markers = "os^vD<>ph*Xd"
  marker = {v: markers[i % len(markers)] for i, v in enumerate(present)}
  for ax, op in zip(axes.flat, ops):
    shapes, variants = ordered(rows, op)
    sweep = op == "all_gather_matmul_sweep"
    xs = {s: (shape_key(s)[0] if sweep else i) for i, s in enumerate(shapes)}
    for v in variants:
      pts = sorted((xs[r["shape"]], r["over_floor"]) for r in rows
                   if r["op"] == op and r["variant"] == v and r["shape"] in xs)
      if not pts:
        continue
      style = "--" if v == "floor" else "-"
      ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker.get(v, "o"),
              ms=4, label=v, color=colors.get(v), lw=2.2 if v == "auto" else 1.1)
    ax.set_title(OP_TITLES.get(op, op), fontsize=9)
    ax.set_ylabel("time / floor")
    if sweep:
      ax.set_xscale("log", base=2)
      ax.set_xticks([xs[s] for s in shapes])
      ax.set_xticklabels([str(xs[s]) for s in shapes], fontsize=7)
      ax.set_xlabel("tokens n")
    else:
      ax.set_xticks(range(len(shapes)))
      ax.set_xticklabels(shapes, rotation=25, ha="right", fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
  for ax in list(axes.flat)[len(ops):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def brief(summary) -> str:
  """A few lines: per op and shape, auto and the best variant over the floor."""
  lines = []
  rows = [r for r in summary["rows"] if r["op"] not in ("mlp_step_memory", "*")]
  for op in [o for o in OP_ORDER if any(r["op"] == o for r in rows)]:
    shapes, _ = ordered(rows, op)
    for s in shapes:
      got = {r["variant"]: r for r in rows if r["op"] == op and r["shape"] == s}
      vals = {v: r["over_floor"] for v, r in got.items()
              if r.get("over_floor") is not None and v != "floor"}
      if not vals:
        lines.append(f"{op} {s}: no timings")
        continue
      best = min(vals, key=vals.get)
      ref = " ".join(f"{v} {vals[v]:.3f}" for v in ("auto", "xla", "pure_jax") if v in vals)
      lines.append(f"{op} {s}: best {best} {vals[best]:.3f} | {ref}")
  mem = [r for r in summary["rows"] if r["op"] == "mlp_step_memory" and r.get("temp_mib") is not None]
  for r in mem:
    lines.append(f"mlp_step_memory {r['shape']} {r['variant']}: temp {r.get('temp_mib')} "
                 f"peak {r.get('peak_mib')} MiB")
  for r in summary["rows"]:
    if r["op"] == "*":
      lines.append(f"part {r['variant']} FAILED: {r.get('error')}")
  return "\n".join(lines)


def summarize(paths):
  parts = load_parts(paths)
  rows, clocks = build_rows(parts)
  machine = next((p.get("machine") for p in parts if p.get("part") == "project" and p.get("machine")),
                 None) or next((p.get("machine") for p in parts if p.get("machine")), {})
  versions = {p.get("part", "?"): p.get("versions", {}) for p in parts if p.get("versions")}
  for p in parts:
    if p.get("part") == "project" and p.get("connect"):
      versions.setdefault("project", {}).update(
          {k: v for k, v in p["connect"].items() if k in ("jax_comm_gemm", "cublasmp_status")})
  profiles = []
  for p in parts:
    for prof in p.get("profiles", []):
      profiles.append({k: v for k, v in prof.items() if k not in ("all_steps_text",)})
  return {"rows": rows, "machine": machine, "versions": versions, "clocks": clocks,
          "profiles": profiles,
          "parts": [{"part": p.get("part"), "file": p.get("_file"), "finished": p.get("finished"),
                     "elapsed_s": p.get("elapsed_s"), "error": p.get("error"),
                     "hangs": p.get("hangs"), "connect": p.get("connect"),
                     "method": p.get("method")} for p in parts]}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("inputs", nargs="+", help="part JSON files or folders of them")
  ap.add_argument("--out-dir", default=".")
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--brief", action="store_true", help="print a short summary")
  a = ap.parse_args(argv)
  summary = summarize(a.inputs)
  os.makedirs(a.out_dir, exist_ok=True)
  with open(os.path.join(a.out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  with open(os.path.join(a.out_dir, "table.md"), "w") as f:
    f.write(markdown(summary) + "\n")
  made = [] if a.no_plot else (["plot.png"] if plot(summary, os.path.join(a.out_dir, "plot.png")) else [])
  print(f"wrote summary.json ({len(summary['rows'])} rows), table.md{', plot.png' if made else ''} "
        f"to {a.out_dir}")
  if a.brief:
    print(brief(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
