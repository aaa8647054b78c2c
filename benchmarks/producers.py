#!/usr/bin/env python3
"""Where a step's device time goes, by what produced each kernel: the GEMMs,
the collectives, and the passes around them (amax, cast, transpose, scale,
norm, activation, attention, optimizer).

It joins two things the benchmarks already write: a jax.profiler trace
(`perfetto_trace.json.gz`; its "XLA Ops" line names each piece of device work
after the HLO instruction that launched it) and the step's optimized HLO
(`compiled.as_text()`, e.g. `benchmarks/fp8_step.py --hlo DIR`). Each
instruction is classed from what it computes (a conversion to an FP8 type is a
cast, a max-reduction of magnitudes an amax, ...) and from the Python source of
its operations, which XLA keeps in the HLO's stack frames (optax's files are
the optimizer, flax's normalization the norm, an "activation" name scope the activation).

  python3 benchmarks/producers.py TRACE_OR_DIR STEP.hlo.txt [--window W] [--top 3] [--json OUT]
                                 [--fusions N]

--window as in trace_summary.py (e.g. the host annotation "train_step").
--fusions N prints, after the table, the N longest instructions outside the
GEMMs and the attention, each with its category, time, name scope and the HLO
it runs: what a profile's row is made of.
Needs only the standard library.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import trace_summary

CATEGORIES = ("gemm", "collective", "attention", "amax", "cast", "transpose", "scale", "norm",
              "activation", "optimizer", "other")
FP8_TYPE = re.compile(r"\bf8e\w+\[")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
               "send", "recv")
# Python sources, innermost frame first: the first rule that a frame matches
# names the producer. jax.nn holds both attention and the activations, so the
# function decides there. jax keeps its own frames out of the HLO, so an
# activation of jax.nn shows only its caller's line: the rules also read the
# instruction's name scope (op_name), where the project's transformer block
# puts its activation under "activation".
SOURCE_RULES = (("optimizer", re.compile(r"/optax/")),
                ("attention", re.compile(r"dot_product_attention|_attention\b|attention\.py")),
                ("norm", re.compile(r"normalization\.py|layer_?norm|rms_?norm|LayerNorm", re.I)),
                ("activation", re.compile(r"\b(gelu|silu|relu|swish|tanh|sigmoid)\b"
                                          r"|/activation/")),
                ("fp8", re.compile(r"jax_comm_gemm/fp8/|/fp8[^/]*\.py")))

INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
                      r"(?P<shape>\([^=]*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<rest>.*)$")
COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
CALLS_RE = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)="
                      r"\{?(?P<names>%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
FRAME_RE = re.compile(r"stack_frame_id=(\d+)")
OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
TABLE_ROW_RE = re.compile(r"^(\d+)\s+(.*)$")


class Module:
  """An optimized HLO module's instructions, computations and stack frames."""

  def __init__(self, text: str):
    self.instructions: dict[str, dict] = {}
    self.computations: dict[str, list[str]] = collections.defaultdict(list)
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    computation, table = None, None
    for line in text.splitlines():
      if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        table = line.strip()
        continue
      if table is not None:
        row = TABLE_ROW_RE.match(line.strip())
        if row:
          tables[table][int(row.group(1))] = row.group(2)
          continue
        table = None
      header = COMP_RE.match(line)
      if header and "=" not in line.split("(")[0]:
        computation = header.group("name")
        continue
      m = INSTR_RE.match(line)
      if m is None or computation is None:
        continue
      rest = m.group("rest")
      calls = [n.strip().lstrip("%") for c in CALLS_RE.finditer(rest)
               for n in c.group("names").split(",")]
      target = TARGET_RE.search(rest)
      frame = FRAME_RE.search(rest)
      op_name = OP_NAME_RE.search(rest)
      self.instructions[m.group("name")] = dict(
          op=m.group("op"), shape=m.group("shape"), calls=calls, line=line,
          target=target.group(1) if target else "",
          frame=int(frame.group(1)) if frame else None,
          op_name=op_name.group(1) if op_name else "")
      self.computations[computation].append(m.group("name"))
    self._files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    self._functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    self._locations = {k: _fields(v) for k, v in tables["FileLocations"].items()}
    self._frames = {k: _fields(v) for k, v in tables["StackFrames"].items()}

  def sources(self, frame: int | None) -> list[str]:
    """'file:function' of a stack frame and its callers, innermost first."""
    out, seen = [], set()
    while frame and frame in self._frames and frame not in seen:
      seen.add(frame)
      location = self._locations.get(self._frames[frame].get("file_location_id"), {})
      out.append(f"{self._files.get(location.get('file_name_id'), '?')}:"
                 f"{self._functions.get(location.get('function_name_id'), '?')}")
      parent = self._frames[frame].get("parent_frame_id")
      frame = None if parent == frame else parent
    return out

  def body(self, name: str) -> list[dict]:
    """The instruction and every instruction of the computations it calls."""
    out, todo, seen = [], [name], set()
    while todo:
      n = todo.pop()
      if n in seen or n not in self.instructions:
        continue
      seen.add(n)
      instr = self.instructions[n]
      out.append(instr)
      for computation in instr["calls"]:
        todo.extend(self.computations.get(computation, ()))
    return out

  def classify(self, name: str) -> str:
    """One of CATEGORIES for the instruction `name` (a fusion is classed by
    what it contains), or for a kernel named after one (XLA names a fusion's
    kernel "loop_x_fusion_3" for "loop_x_fusion.3"); a kernel of a library
    (cuBLAS, cuDNN, NCCL) by its name."""
    name = name.lstrip("%").split(" ")[0]
    if name not in self.instructions:
      name = re.sub(r"_(\d+)$", r".\1", name)
    if name not in self.instructions:
      if re.search(r"fmha|sdpa|flash", name, re.I):
        return "attention"
      kind = next((k for k, rule in trace_summary.KINDS if rule.search(name)), "other")
      return kind if kind in CATEGORIES else "other"
    instrs = self.body(name)
    ops = {i["op"] for i in instrs}
    targets = " ".join(i["target"] for i in instrs).lower()
    if "cudnn" in targets and ("fmha" in targets or "sdpa" in targets or "attention" in targets):
      return "attention"
    if ops & {"dot", "convolution"} or re.search(r"gemm|cublas|matmul", targets):
      return "gemm"
    if any(op.startswith(c) for op in ops for c in COLLECTIVES):
      return "collective"
    producer = None
    for i in instrs:
      # Its name scope, then its Python frames innermost first: the first hit counts.
      for source in [i["op_name"]] + (self.sources(i["frame"]) if i["frame"] else []):
        hit = next((kind for kind, rule in SOURCE_RULES if rule.search(source)), None)
        if hit:
          if producer is None or _rank(hit) < _rank(producer):
            producer = hit
          break
    fp8_out = any(i["op"] == "convert" and FP8_TYPE.search(i["shape"]) for i in instrs)
    # A max-reduction (its to_apply computes a maximum), or the magnitudes for one.
    max_reduce = any(self.instructions.get(n, {}).get("op") == "maximum"
                     for i in instrs if i["op"] == "reduce"
                     for c in i["calls"] for n in self.computations.get(c, ()))
    # What the fusion computes, without the fusion itself and its plumbing.
    work = ops - {"fusion", "parameter", "bitcast"}
    amax = max_reduce or work <= {"abs", "convert"} and "abs" in work
    if producer in ("optimizer", "attention"):
      return producer
    if amax:
      return "amax"
    if fp8_out:
      return "cast"
    if producer in ("norm", "activation"):
      return producer
    if work & {"transpose", "copy"} and work <= {"transpose", "copy", "convert"}:
      return "transpose"
    if producer == "fp8":
      return "scale"
    return "other"


def _rank(kind: str) -> int:
  return [k for k, _ in SOURCE_RULES].index(kind)


def _fields(text: str) -> dict[str, int]:
  return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}


def xla_op_times(trace: dict, window: str | None) -> dict[str, tuple[float, int]]:
  """{HLO instruction: (us, count)} from the GPUs' "XLA Ops" lines in the
  window; {kernel: (us, count)} from their streams where a trace has no such line."""
  span = trace_summary.resolve_window(trace, window)
  if window and span is None:
    raise ValueError(f"--window {window!r}: no such span in the trace")
  lo, hi = (span[0], span[1]) if span else (float("-inf"), float("inf"))
  on_device = {key: name for key, name in trace["tname"].items()
               if trace_summary.is_device(trace["pname"].get(key[0], ""))}
  lines = {key for key, name in on_device.items() if name == "XLA Ops"} or {
      key for key, name in on_device.items() if name not in trace_summary.DERIVED_LINES}
  out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  for pid, tid, ts, dur, name in trace["events"]:
    if (pid, tid) not in lines:
      continue
    start, end = max(ts, lo), min(ts + dur, hi)
    if end > start:
      out[name][0] += end - start
      out[name][1] += 1
  return {k: (v[0], v[1]) for k, v in out.items()}


def summarize(times: dict[str, tuple[float, int]], module: Module, top: int = 3) -> dict:
  """{category: {"us", "count", "top": [(instruction, us)]}} and the total."""
  by: dict[str, dict] = {c: {"us": 0.0, "count": 0, "top": []} for c in CATEGORIES}
  for name, (us, count) in times.items():
    entry = by[module.classify(name)]
    entry["us"] += us
    entry["count"] += count
    entry["top"].append((name, us))
  for entry in by.values():
    entry["top"] = sorted(entry["top"], key=lambda t: -t[1])[:top]
  return {"categories": by, "total_us": sum(e["us"] for e in by.values())}


def format_table(s: dict) -> str:
  total = s["total_us"] or 1.0
  rows = ["| category | us | share | ops | largest |", "| --- | --- | --- | --- | --- |"]
  for category in CATEGORIES:
    e = s["categories"][category]
    if e["count"]:
      largest = ", ".join(f"{n} {us:.0f}" for n, us in e["top"])
      rows.append(f"| {category} | {e['us']:.1f} | {e['us'] / total:.1%} | {e['count']} | "
                  f"{largest} |")
  rows.append(f"| all | {s['total_us']:.1f} | 100% | | |")
  return "\n".join(rows)


def longest(times: dict[str, tuple[float, int]], module: Module, n: int,
            skip=("gemm", "attention")) -> str:
  """The `n` longest instructions of `times` whose category is not in `skip`:
  a header line each (category, us, count, name scope), then the HLO lines
  of its body, each cut to 200 characters."""
  out = []
  rows = sorted(((us, count, name) for name, (us, count) in times.items()
                 if module.classify(name) not in skip), reverse=True)[:n]
  for us, count, name in rows:
    key = name.lstrip("%").split(" ")[0]
    key = key if key in module.instructions else re.sub(r"_(\d+)$", r".\1", key)
    body = module.body(key)
    scope = body[0]["op_name"] if body else ""
    out.append(f"## {name}: {module.classify(name)}, {us:.0f} us x{count}, {scope}")
    out += [i["line"].strip()[:200] for i in body]
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("trace")
  p.add_argument("hlo")
  p.add_argument("--window")
  p.add_argument("--top", type=int, default=3)
  p.add_argument("--json")
  p.add_argument("--fusions", type=int, default=0, metavar="N")
  a = p.parse_args(argv)
  with open(a.hlo) as f:
    module = Module(f.read())
  times = xla_op_times(trace_summary.load(a.trace), a.window)
  s = summarize(times, module, a.top)
  print(format_table(s))
  if a.fusions:
    print()
    print(longest(times, module, a.fusions))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(s, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
