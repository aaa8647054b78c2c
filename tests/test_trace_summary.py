"""benchmarks/trace_summary.py on tiny synthetic traces, one per format: jax's
perfetto trace and torch.profiler's (kineto) Chrome trace. Both hold the same
timeline (us, from the trace's origin):

  host annotations   bench_step_0 [0, 100]  bench_step_1 [100, 200]
  compute stream     gemm [10, 60]  gemm [110, 160]  gemm [300, 320]
  copy stream        copy [40, 80]  copy [140, 180]

so: busy 160 over the whole trace (span 310), 140 in bench_step_ (idle 60),
70 in bench_step_#1; the two streams overlap 40 (20 per step)."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import trace_summary  # noqa: E402

STEPS = (("bench_step_0", 0, 100), ("bench_step_1", 100, 100))
GEMMS = ((10, 50), (110, 50), (300, 20))
COPIES = ((40, 40), (140, 40))


def meta(kind, pid, tid, name):
  return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def x(name, pid, tid, ts, dur, **extra):
  return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, **extra}


def jax_trace(t0=1000.0):
  ev = [meta("process_name", 1, 0, "/device:GPU:0"), meta("process_name", 9, 0, "/host:CPU"),
        meta("thread_name", 1, 13, "Stream #13(compute)"), meta("thread_name", 1, 14, "Stream #14(nccl)"),
        meta("thread_name", 1, 2, "XLA Ops"), meta("thread_name", 9, 1, "python")]
  ev += [x(n, 9, 1, t0 + ts, d) for n, ts, d in STEPS]
  ev += [x("nvjet_gemm", 1, 13, t0 + ts, d) for ts, d in GEMMS]
  ev += [x("MemcpyP2P", 1, 14, t0 + ts, d) for ts, d in COPIES]
  ev += [x("fusion.1", 1, 2, t0 + 10, 170)]  # a derived line: not a stream
  return {"displayTimeUnit": "ns", "traceEvents": ev}


def torch_trace(t0=5000.0, device=0):
  """As kineto writes it: GPU events on pid=device, tid=stream, with args."""
  host, thread = 4242, 4243

  def gpu(name, cat, stream, ts, d):
    return x(name, device, stream, t0 + ts, d, cat=cat,
             args={"device": device, "stream": stream, "correlation": 1})

  ev = [meta("process_name", host, 0, "python3"), meta("process_name", device, 0, f"GPU {device}"),
        meta("thread_name", host, thread, "thread 4243 (python3)"),
        meta("thread_name", device, 7, "stream 7"), meta("thread_name", device, 20, "stream 20")]
  ev += [x(n, host, thread, t0 + ts, d, cat="user_annotation") for n, ts, d in STEPS]
  ev += [x("aten::mm", host, thread, t0 + 2, 5, cat="cpu_op"),
         x("cudaLaunchKernel", host, thread, t0 + 3, 3, cat="cuda_runtime"),
         x("ProfilerStep", "Spans", "x", t0, 400, cat="Trace")]
  ev += [gpu("nvjet_gemm", "kernel", 7, ts, d) for ts, d in GEMMS]
  ev += [gpu("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 20, ts, d) for ts, d in COPIES]
  # Not work either: a synchronisation (cuda_sync, kineto's sync events) on a GPU line,
  # and record_function's GPU copies (one has no host twin: the fallback).
  ev += [x("Stream Sync", device, 7, t0 + 60, 40, cat="cuda_sync",
           args={"device": device, "stream": 7})]
  ev += [gpu("bench_step_0", "gpu_user_annotation", 7, 5, 85),
         gpu("bench_step_1", "gpu_user_annotation", 7, 105, 85),
         gpu("gpu_only", "gpu_user_annotation", 7, 105, 80)]
  ev += [{"ph": "s", "id": 1, "pid": host, "tid": thread, "ts": t0 + 3, "cat": "ac2g", "name": "ac2g"},
         {"ph": "f", "id": 1, "pid": device, "tid": 7, "ts": t0 + 10, "cat": "ac2g", "name": "ac2g",
          "bp": "e"},
         {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": t0 + 500}]
  return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": ev}


def write(tmp_path, name, data):
  path = tmp_path / name
  with gzip.open(path, "wt") as f:
    json.dump(data, f)
  return str(path)


@pytest.fixture(params=["jax", "torch"])
def trace(request, tmp_path):
  if request.param == "jax":
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    write(folder, "perfetto_trace.json.gz", jax_trace())
    streams = ("Stream #13(compute)", "Stream #14(nccl)")
    path = str(tmp_path)  # find_trace looks inside
  else:
    path = write(tmp_path, "all_gather_matmul_4096x4096x4096_torch_symm_mem_rank0.trace.json.gz",
                 torch_trace())
    streams = ("stream 7", "stream 20")
  return request.param, trace_summary.load(path), streams


def summary(t, window=None):
  return trace_summary.summarize(t, window=window)


def check(s, streams, busy, span, overlap, compute, copy):
  assert list(s["devices"]) == ["GPU0"]
  d = s["devices"]["GPU0"]
  assert set(d["streams"]) == set(streams)
  assert d["busy_us"] == pytest.approx(busy)
  assert d["span_us"] == pytest.approx(span)
  assert d["idle_us"] == pytest.approx(span - busy)
  assert d["overlap_2plus_us"] == pytest.approx(overlap)
  assert d["streams"][streams[0]]["busy_us"] == pytest.approx(compute)
  assert d["streams"][streams[1]]["busy_us"] == pytest.approx(copy)
  return d


def test_whole_trace(trace):
  _, t, streams = trace
  d = check(summary(t), streams, busy=160, span=310, overlap=40, compute=120, copy=80)
  gemm, copy = d["streams"][streams[0]], d["streams"][streams[1]]
  assert (gemm["kernels"], gemm["copies"], copy["kernels"], copy["copies"]) == (3, 0, 0, 2)
  assert gemm["gap_sum_us"] == pytest.approx(50 + 140)
  assert (gemm["gaps_over_10us"], gemm["gap_max_us"]) == (2, pytest.approx(140))
  assert d["top"][0][:2] == ["nvjet_gemm", 3] and d["top"][0][2] == pytest.approx(120)


def test_window_all_steps(trace):
  _, t, streams = trace
  s = summary(t, "bench_step_")
  assert s["window_us"] == pytest.approx(200) and "2 annotations" in s["window"]
  d = check(s, streams, busy=140, span=200, overlap=40, compute=100, copy=80)
  # From the first GEMM (10) to the last copy's end (180): the 30 us between
  # the steps' work is idle; the window's edges (10 + 20) are not in it.
  assert d["active_us"] == pytest.approx(170) and d["inner_idle_us"] == pytest.approx(30)
  assert d["by_kind"]["gemm"][0] == 2 and d["by_kind"]["gemm"][1] == pytest.approx(100)
  assert d["by_kind"]["copy"][0] == 2 and d["by_kind"]["copy"][1] == pytest.approx(80)
  assert set(d["by_kind"]) == {"gemm", "copy"}


def test_kinds_count_every_kernel_not_only_the_top_ones(tmp_path):
  """A device's totals by kind and its top list come from every event, not
  from each stream's few top kernels (GPU run 44's summaries undercounted)."""
  names = [f"nvjet_gemm_{i}" for i in range(6)] + ["ncclDevKernel_SendRecv", "loop_fusion"]
  ev = [meta("process_name", 1, 0, "/device:GPU:0"), meta("thread_name", 1, 13, "Stream #13")]
  ev += [x(n, 1, 13, 100.0 * i, 10.0) for i, n in enumerate(names)]
  tr = trace_summary.load(write(tmp_path, "perfetto_trace.json.gz", {"traceEvents": ev}))
  d = trace_summary.summarize(tr, top=2)["devices"]["GPU0"]
  assert d["by_kind"] == {"gemm": [6, pytest.approx(60)], "collective": [1, pytest.approx(10)],
                          "other": [1, pytest.approx(10)]}
  assert len(d["top"]) == 2


def test_window_one_step(trace):
  _, t, streams = trace
  s = summary(t, "bench_step_#1")
  assert s["window_us"] == pytest.approx(100)
  check(s, streams, busy=70, span=100, overlap=20, compute=50, copy=40)


def test_window_times(trace):
  _, t, streams = trace
  s = summary(t, "0:50")  # from the first event, the host annotation at 0
  check(s, streams, busy=40, span=50, overlap=10, compute=40, copy=10)


def test_window_gpu_annotation_fallback(trace):
  kind, t, streams = trace
  s = summary(t, "gpu_only")
  if kind == "jax":
    assert s["note"] and s["window"] == "whole trace"
  else:  # [105, 185]
    assert s["window_us"] == pytest.approx(80) and s["note"] is None
    check(s, streams, busy=70, span=80, overlap=20, compute=50, copy=40)


def test_torch_second_device(tmp_path):
  t = trace_summary.load(write(tmp_path, "x_rank1.trace.json.gz", torch_trace(device=1)))
  assert list(trace_summary.summarize(t)["devices"]) == ["GPU1"]


def test_cli_text(trace, capsys):
  _, t, streams = trace
  assert trace_summary.main([t["path"], "--window", "bench_step_"]) == 0
  out = capsys.readouterr().out
  assert "GPU0: busy 140.0 us of 200.0 (70%), >=2 streams busy 40.0 us, idle 60.0 us, 2 streams" in out
  assert ("  first to last work 170.0 us, idle inside it 30.0 us; gemm 100.0 us x2, "
          "copy 80.0 us x2") in out
  assert f"  {streams[0]}: 2 kernels + 0 copies, busy 100.0 us" in out
  assert f"  {streams[1]}: 0 kernels + 2 copies, busy 80.0 us" in out


def test_timeline_in_start_order(trace, capsys):
  """--timeline lists the window's work by start, from the device's first work."""
  _, t, streams = trace
  assert "timeline" not in summary(t, "bench_step_#1")["devices"]["GPU0"]
  d = trace_summary.summarize(t, window="bench_step_#1", timeline=5)["devices"]["GPU0"]
  assert [(round(s), round(e), st) for s, e, st, _ in d["timeline"]] == [
      (0, 50, streams[0]), (30, 70, streams[1])]
  assert trace_summary.main([t["path"], "--window", "bench_step_#1", "--timeline", "1"]) == 0
  out = capsys.readouterr().out
  listed = out.split("GPU0 timeline", 1)[1].splitlines()[1:]
  assert len(listed) == 1 and listed[0].split()[:3] == ["0.0", "50.0", "50.0"]
