#!/usr/bin/env python3
"""Summarises a jax.profiler trace: `perfetto_trace.json.gz`, written by
`jax.profiler.trace(dir, create_perfetto_trace=True)` (plain Chrome-trace JSON),
or a torch.profiler one (`prof.export_chrome_trace`, kineto's Chrome trace;
benchmarks/peers/torch_symm_mem.py --profile writes `*.trace.json.gz`).

Per device and per stream: busy time (the union of its events), how many
kernels and copies, the gaps between them (sum, count over 10 us, largest), the
top kernels by time; per device: the time during which two or more of its
streams are busy at once (overlap), the idle time in the window and inside the
span from the device's first work to its last (the window's edges are host
time), and the time by kind of work (GEMMs, collectives, copies, other).

  python3 benchmarks/trace_summary.py TRACE_OR_DIR [--window W] [--top 8] [--json OUT]
                                      [--timeline N]

--timeline N also lists each device's first N pieces of work in the window in
the order they started: start and end from the device's first work, stream,
name. The totals say whether copies overlapped GEMMs; the timeline says which
waited for which.

--window restricts everything to one span:
  T0:T1          microseconds from the trace's first event
  NAME           the span of the host annotations whose name starts with NAME
                 (bench.py --profile marks each step "bench_step_<i>"; in a
                 torch trace, record_function ranges; if no host one matches,
                 their GPU copies, gpu_user_annotation)
  NAME#K         the K-th (0-based) such annotation
Events are clipped to the window. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

DEVICE_RE = re.compile(r"/device:(GPU|TPU):(\d+)")
# Lines of a device that xprof derives from the streams; they are not streams.
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Launch Stats", "TensorFlow Ops",
                 "Framework Ops", "TensorFlow Name Scope", "Source code", "Framework Name Scope",
                 "XLA TraceMe", "Async XLA Ops", "SparseCore")
COPY_RE = re.compile(r"memcpy|memset|MemcpyD2D|MemcpyP2P|MemcpyH2D|MemcpyD2H", re.I)
# What a device's time went to, by kernel name (the first kind that matches).
KINDS = (("copy", COPY_RE),
         ("collective", re.compile(r"nccl|barrier|AllGather|AllReduce|ReduceScatter|SendRecv",
                                   re.I)),
         ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|matmul|cublas", re.I)))
# torch.profiler (kineto): the categories of GPU work, on lines args.device/args.stream.
TORCH_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 10.0


def find_trace(path: str) -> str:
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not found:
      raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return found[-1]
  return path


def load(path: str) -> dict:
  """{"events": [(pid, tid, ts, dur, name)], "pname": {pid: name},
  "tname": {(pid, tid): name}, "path": path}."""
  path = find_trace(path)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  raw = data.get("traceEvents", []) if isinstance(data, dict) else data
  if any(isinstance(e, dict) and e.get("cat") in TORCH_GPU_CATS for e in raw):
    return dict(load_torch(raw), path=path)
  pname, tname, events = {}, {}, []
  open_b = collections.defaultdict(list)
  for e in raw:
    if not isinstance(e, dict):
      continue
    ph = e.get("ph")
    if ph == "M":
      if e.get("name") == "process_name":
        pname[e.get("pid")] = str(e.get("args", {}).get("name", ""))
      elif e.get("name") == "thread_name":
        tname[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    elif ph == "X" and "ts" in e:
      events.append((e.get("pid"), e.get("tid"), float(e["ts"]), float(e.get("dur", 0.0)),
                     str(e.get("name", ""))))
    elif ph == "B" and "ts" in e:
      open_b[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), str(e.get("name", ""))))
    elif ph == "E" and "ts" in e:
      stack = open_b.get((e.get("pid"), e.get("tid")))
      if stack:
        ts, name = stack.pop()
        events.append((e.get("pid"), e.get("tid"), ts, float(e["ts"]) - ts, name))
  return {"events": events, "pname": pname, "tname": tname, "path": path}


def load_torch(raw: list) -> dict:
  """load() of a torch.profiler (kineto) trace. GPU work is "X" events of
  category kernel, gpu_memcpy or gpu_memset; each (args.device, args.stream)
  becomes the line "stream <s>" of a process "/device:GPU:<d>", as in jax's
  traces. Every other process is marked "/host:" (cpu_op, user_annotation,
  cuda_runtime...). gpu_user_annotation events (record_function's ranges on the
  GPU) are not work: they go to "gpu_marks", for --window."""
  pname, tname, events, gpu_marks = {}, {}, [], []
  for e in raw:
    if not isinstance(e, dict):
      continue
    ph, cat, args = e.get("ph"), e.get("cat"), e.get("args") or {}
    if ph == "M":
      if e.get("name") == "process_name":
        pname[e.get("pid")] = "/host:" + str(args.get("name", ""))
      elif e.get("name") == "thread_name":
        tname[(e.get("pid"), e.get("tid"))] = str(args.get("name", ""))
      continue
    if ph != "X" or "ts" not in e:
      continue
    ts, dur, name = float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", ""))
    if cat in TORCH_GPU_CATS:
      dev, stream = args.get("device", e.get("pid")), args.get("stream", e.get("tid"))
      pid = f"torch_gpu:{dev}"
      pname[pid] = f"/device:GPU:{dev}"
      tname[(pid, stream)] = f"stream {stream}"
      events.append((pid, stream, ts, dur, name))
    elif cat == "gpu_user_annotation":
      gpu_marks.append((ts, dur, name))
    else:
      events.append((e.get("pid"), e.get("tid"), ts, dur, name))
  return {"events": events, "pname": pname, "tname": tname, "gpu_marks": gpu_marks}


def is_device(pname: str) -> bool:
  return bool(DEVICE_RE.search(pname)) or ("GPU" in pname and "/host" not in pname)


def device_label(pname: str, pid) -> str:
  m = DEVICE_RE.search(pname)
  return f"{m.group(1)}{m.group(2)}" if m else f"{pname or 'pid'}:{pid}"


def stream_threads(trace: dict, include_host: bool) -> dict:
  """{(pid, tid): (device label, stream label)} of the lines to analyse."""
  by_pid = collections.defaultdict(set)
  for pid, tid, *_ in trace["events"]:
    by_pid[pid].add(tid)
  out = {}
  for pid, tids in by_pid.items():
    pn = trace["pname"].get(pid, "")
    if not is_device(pn) and not include_host:
      continue
    names = {tid: trace["tname"].get((pid, tid), str(tid)) for tid in tids}
    streams = [t for t, n in names.items() if "stream" in n.lower()]
    if not streams:
      streams = [t for t, n in names.items() if not any(n.startswith(d) for d in DERIVED_LINES)]
    for tid in streams:
      out[(pid, tid)] = (device_label(pn, pid), names[tid])
  return out


def resolve_window(trace: dict, window: str | None):
  """(t0, t1, description) in trace microseconds, or None for the whole trace."""
  if not window:
    return None
  events = trace["events"]
  origin = min((e[2] for e in events), default=0.0)
  m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", window)
  if m:
    return origin + float(m.group(1)), origin + float(m.group(2)), f"{window} us"
  name, _, idx = window.partition("#")
  marks = sorted({(e[2], e[3]) for e in events
                  if not is_device(trace["pname"].get(e[0], "")) and e[4].startswith(name)})
  if not marks:  # torch: the GPU side of record_function
    marks = sorted({(ts, d) for ts, d, n in trace.get("gpu_marks", ()) if n.startswith(name)})
  if not marks:
    return None
  if idx:
    k = int(idx)
    if k >= len(marks):
      return None
    marks = [marks[k]]
  t0 = min(ts for ts, _ in marks)
  t1 = max(ts + d for ts, d in marks)
  return t0, t1, f"{window} ({len(marks)} annotation{'s' if len(marks) != 1 else ''})"


def merge(intervals):
  out = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return out


def overlap_at_least(stream_intervals: list, k: int = 2) -> float:
  """Time during which at least k of the (merged, per-stream) interval lists are busy."""
  points = []
  for ivs in stream_intervals:
    for s, e in ivs:
      points.append((s, 1))
      points.append((e, -1))
  points.sort(key=lambda p: (p[0], p[1]))
  total, depth, last = 0.0, 0, None
  for t, d in points:
    if depth >= k and last is not None:
      total += t - last
    depth += d
    last = t
  return total


def summarize(trace: dict, window: str | None = None, top: int = 8,
              include_host: bool = False, timeline: int = 0) -> dict:
  """The summary of one window; with timeline > 0 each device also lists its
  first `timeline` pieces of work ("timeline": [start, end, stream, name], us
  from the device's first work)."""
  lines = stream_threads(trace, include_host)
  win = resolve_window(trace, window)
  note = None
  if window and win is None:
    note = f"window {window!r} not found: whole trace"
  per_line = collections.defaultdict(list)
  for pid, tid, ts, dur, name in trace["events"]:
    key = (pid, tid)
    if key not in lines:
      continue
    s, e = ts, ts + max(dur, 0.0)
    if win:
      s, e = max(s, win[0]), min(e, win[1])
      if e <= s and not (dur == 0 and win[0] <= ts <= win[1]):
        continue
    per_line[key].append((s, e, name))
  if win and not per_line and any(key in lines for key in
                                  ((e[0], e[1]) for e in trace["events"])):
    # Device and host clocks disagree, or the window holds no device work: say
    # so, and summarise the whole trace instead.
    whole = summarize(trace, None, top, include_host, timeline)
    whole["note"] = f"no device events inside window {window!r}: whole trace"
    return whole
  devices = collections.defaultdict(dict)
  for key, evs in per_line.items():
    dev, stream = lines[key]
    merged = merge([(s, e) for s, e, _ in evs])
    busy = sum(e - s for s, e in merged)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    kernels = collections.defaultdict(lambda: [0, 0.0])
    n_copy = 0
    for s, e, name in evs:
      kernels[name][0] += 1
      kernels[name][1] += e - s
      n_copy += bool(COPY_RE.search(name))
    devices[dev][stream] = {
        "events": len(evs), "kernels": len(evs) - n_copy, "copies": n_copy,
        "busy_us": busy, "first_us": merged[0][0] if merged else None,
        "last_us": merged[-1][1] if merged else None,
        "gap_sum_us": sum(gaps), "gaps_over_10us": sum(g > GAP_US for g in gaps),
        "gap_max_us": max(gaps, default=0.0),
        "top": sorted(([n, c, t] for n, (c, t) in kernels.items()), key=lambda r: -r[2])[:top],
        "_merged": merged, "_kernels": kernels,
    }
  out = {"trace": trace.get("path"), "window": win[2] if win else "whole trace",
         "window_us": (win[1] - win[0]) if win else None, "note": note, "devices": {}}
  for dev in sorted(devices):
    streams = devices[dev]
    merged_all = merge([iv for st in streams.values() for iv in st["_merged"]])
    busy = sum(e - s for s, e in merged_all)
    if win:
      span = win[1] - win[0]
    else:
      span = (max(e for _, e in merged_all) - min(s for s, _ in merged_all)) if merged_all else 0.0
    totals = collections.defaultdict(lambda: [0, 0.0])
    for st in streams.values():
      for n, (c, t) in st["_kernels"].items():
        totals[n][0] += c
        totals[n][1] += t
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for n, (c, t) in totals.items():
      kind = next((k for k, pattern in KINDS if pattern.search(n)), "other")
      by_kind[kind][0] += c
      by_kind[kind][1] += t
    # From the device's first work to its last: the window's edges are host
    # time (launches before the first kernel, the wait after the last), not
    # gaps between the device's own work.
    active = (merged_all[-1][1] - merged_all[0][0]) if merged_all else 0.0
    out["devices"][dev] = {
        "span_us": span, "busy_us": busy, "idle_us": max(0.0, span - busy),
        "active_us": active, "inner_idle_us": max(0.0, active - busy),
        "by_kind": {k: v for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "overlap_2plus_us": overlap_at_least([st["_merged"] for st in streams.values()], 2),
        "streams": {name: {k: v for k, v in st.items() if not k.startswith("_")}
                    for name, st in sorted(streams.items(), key=lambda kv: -kv[1]["busy_us"])},
        "top": sorted(([n, c, t] for n, (c, t) in totals.items()), key=lambda r: -r[2])[:top],
    }
    if timeline > 0:
      work = []  # built only when asked: it holds every event of the device
      for key, evs in per_line.items():
        if lines[key][0] == dev:
          work += [(s, e, lines[key][1], name) for s, e, name in evs]
      work.sort()
      out["devices"][dev]["timeline"] = [[s - merged_all[0][0], e - merged_all[0][0], stream, name]
                                         for s, e, stream, name in work[:timeline]]
  return out


def _name(n: str, width: int = 90) -> str:
  return n if len(n) <= width else n[: width - 3] + "..."


def format_timeline(s: dict, n: int) -> str:
  """Each device's first n pieces of work, in the order they started."""
  out = []
  for dev, d in s["devices"].items():
    out.append(f"{dev} timeline (us from its first work; start end duration stream name):")
    for start, end, stream, name in d.get("timeline", [])[:n]:
      out.append(f"  {start:9.1f} {end:9.1f} {end - start:8.1f}  {_name(stream, 24):24s} "
                 f"{_name(name, 70)}")
  return "\n".join(out)


def format_summary(s: dict, title: str | None = None) -> str:
  out = []
  if title:
    out.append(f"== {title}")
  win = s["window"] + (f", {s['window_us']:.1f} us" if s.get("window_us") else "")
  out.append(f"trace: {s.get('trace')}\nwindow: {win}")
  if s.get("note"):
    out.append(f"note: {s['note']}")
  if not s["devices"]:
    out.append("no device streams found (a CPU trace? try --include-host)")
  for dev, d in s["devices"].items():
    pct = 100.0 * d["busy_us"] / d["span_us"] if d["span_us"] else 0.0
    out.append(f"{dev}: busy {d['busy_us']:.1f} us of {d['span_us']:.1f} ({pct:.0f}%), "
               f">=2 streams busy {d['overlap_2plus_us']:.1f} us, idle {d['idle_us']:.1f} us, "
               f"{len(d['streams'])} streams")
    kinds = ", ".join(f"{k} {t:.1f} us x{c}" for k, (c, t) in d["by_kind"].items())
    out.append(f"  first to last work {d['active_us']:.1f} us, idle inside it "
               f"{d['inner_idle_us']:.1f} us; {kinds}")
    for name, st in d["streams"].items():
      out.append(f"  {_name(name, 40)}: {st['kernels']} kernels + {st['copies']} copies, "
                 f"busy {st['busy_us']:.1f} us, gaps {st['gap_sum_us']:.1f} us "
                 f"({st['gaps_over_10us']} > {GAP_US:.0f} us, max {st['gap_max_us']:.1f})")
      for n, c, t in st["top"][:4]:
        out.append(f"      {t:9.1f} us x{c:<4d} {_name(n)}")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("trace", help="perfetto_trace.json.gz or *.trace.json.gz, or a folder holding one")
  p.add_argument("--window", help="T0:T1 (us), NAME or NAME#K (host annotations)")
  p.add_argument("--top", type=int, default=8)
  p.add_argument("--include-host", action="store_true", help="treat host threads as streams too")
  p.add_argument("--json", help="also write the summary as JSON")
  p.add_argument("--timeline", type=int, default=0, metavar="N",
                 help="also list each device's first N pieces of work")
  a = p.parse_args(argv)
  s = summarize(load(a.trace), window=a.window, top=a.top, include_host=a.include_host,
                timeline=a.timeline)
  print(format_summary(s))
  if a.timeline:
    print(format_timeline(s, a.timeline))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(s, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
