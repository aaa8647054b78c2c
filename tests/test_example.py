"""examples/train_byte_gpt.py, run as a user would (in a subprocess, output
not a terminal), on the CPU: 8 simulated devices, mesh dp=4 x tp=2, where every
layer takes the XLA fallback. Small sizes keep each run to a few seconds.

* A run in FP8 with delayed scaling trains (the loss falls), prints progress
  lines, its layer report and the collective counts, and writes checkpoints; a
  resumed run continues from the last one and repeats the steps the first run
  took after it, loss for loss (the amax histories are in the checkpoints).
  The other runs check the float path's report, with the fallback's reason.
* Options (bfloat16, --keep-gathered-input, --remat, the A/B) and two
  processes joined by jax.distributed.
* tp = 1 (one device, as on a machine with one GPU): the run trains on XLA,
  skips the tuning and the A/B with the reason, and its report matches.
* The loop reads each step's loss after dispatching the next step (save where
  a validation or a checkpoint needs it first), and records every step once.
* Help text and defaults for every option; clear errors.
* diagnostics.report, which says what each layer runs and what a block should
  count, for every backend.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU_TEST_FLAGS, cpu_mesh
from fake_native import install_fake_native
import jax_comm_gemm as jcg
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.backends import Capability, CublasMpBackend
from jax_comm_gemm.diagnostics import hlo, report
from jax_comm_gemm.runtime.registry import current_plan
import jax_comm_gemm.backends.tuning as tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "train_byte_gpt.py"
sys.path.insert(0, str(EXAMPLES))

import run_report  # noqa: E402
import byte_gpt  # noqa: E402
import train_byte_gpt  # noqa: E402

SMALL = ("--d-model", "64", "--heads", "2", "--layers", "2", "--hidden", "128",
         "--seq-len", "64", "--batch", "8", "--eval-batches", "2", "--sample-bytes", "0")


def run_example(tmp_path, *flags, name="summary", devices=8):
  out = tmp_path / f"{name}.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {CPU_TEST_FLAGS}",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")])))
  env.pop("JAX_COMM_GEMM_BACKEND", None)
  proc = subprocess.run([sys.executable, str(EXAMPLE), *SMALL, "--json-out", str(out),
                         "--out-dir", str(tmp_path / name), *flags], env=env,
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout, proc.stderr, json.loads(out.read_text())


def check_report(stdout, summary, layers, remat=False):
  """The report of a run of the example's default blocks (llama) on the XLA fallback."""
  reason = "cuBLASMp is unavailable"
  fc1, fc2 = run_report.MLP_NAMES["llama"]
  for i in range(layers):
    assert re.search(rf"block{i}: +qkv xla fallback +out-proj xla fallback +{fc1} xla "
                     rf"fallback +{fc2} xla fallback", stdout), stdout
  # Each path, then the reason they share once.
  assert (f"qkv, {fc1} (column-parallel): xla fallback\n  out-proj, {fc2} (row-parallel): "
          f"xla fallback\n  why: {reason}") in stdout, stdout
  assert stdout.count(reason) == 1, stdout
  assert summary["paths"]["row_parallel"]["path"] == "xla fallback"
  assert "MISMATCH" not in stdout and "all-gathers in the blocks" in stdout
  # XLA fallback, per block: QKV's and fc1's forward gathers, out-proj's and
  # fc2's dgrad gathers (their weight gradients reuse them); remat reruns the
  # forward two.
  per_block = 6 if remat else 4
  assert summary["counts"]["standalone_all_gathers"] == per_block * layers
  assert summary["expected"] == {"standalone_all_gathers": per_block * layers,
                                 "fused_all_gather_matmuls": 0}
  assert summary["counts"]["fused_all_gather_matmuls"] == 0
  assert summary["counts"]["reduce_scatters"] == (5 if remat else 4) * layers


def test_train_checkpoint_and_resume(tmp_path, capsys):
  """In FP8 with delayed scaling: the checkpoints must hold the amax histories
  as well as the parameters, or the resumed run's scales, and so its losses,
  would differ. (The other runs here check the float path's report.)"""
  checkpoints = tmp_path / "checkpoints"
  # One block: the checkpoints hold whatever the model has, and each block more
  # costs every run here a longer compile and save (the other runs have two).
  flags = ("--layers", "1", "--steps", "12", "--checkpoint-every", "6", "--eval-every", "6",
           "--log-every", "3", "--fp8", "delayed", "--checkpoint-dir", str(checkpoints))
  stdout, _, first = run_example(tmp_path, *flags, "--sample-bytes", "24", name="first")
  train, val = first["history"]["train"], first["history"]["validation"]
  assert [s for s, _ in train] == list(range(1, 13))
  assert train[-1][1] < 0.9 * train[0][1], train
  assert [s for s, _ in val] == [0, 6, 12] and val[-1][1] < 0.9 * val[0][1], val
  assert first["tokens_per_s"] > 0 and first["mesh"] == {"dp": 4, "tp": 2}
  # Not a terminal: progress lines, no progress bar.
  assert "\r" not in stdout
  assert re.search(r"step +12/12 +loss \d\.\d{4} +[\d,]+ tokens/s", stdout), stdout
  assert "validation loss" in stdout and "tokens/s" in stdout
  assert re.search(r"block0: +qkv fp8 on xla +out-proj fp8 on xla", stdout), stdout
  assert "FP8 (delayed scaling)" in stdout and "MISMATCH" not in stdout
  assert first["counts"]["standalone_all_gathers"] == first["expected"][
      "standalone_all_gathers"] == 4
  assert first["checkpoint_steps"] == first["checkpoints_kept"] == [6, 12]
  assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["12", "6"]
  assert (f"checkpoints: 2 saved this run (steps [6, 12]); {checkpoints} holds the last 2 "
          "(steps [6, 12]") in stdout
  # What the run shows at its end: the loss plot and a sample of text, where it says.
  out = tmp_path / "first"
  plot, sample = out / "loss.png", out / "sample.txt"
  assert first["outputs"] == {"plot": str(plot), "sample": str(sample)}
  assert f"loss plot: {plot}" in stdout and f"both in {sample}" in stdout
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
  prompt, continuation = sample.read_bytes().split(b"\n--- the model's continuation ---\n")
  assert len(prompt) == 32 and len(continuation) == 24 + 1, sample.read_bytes()
  assert "sample (24 bytes after a 32-byte prompt" in stdout

  # As if the run had stopped after step 6: resume, and repeat steps 7..12.
  shutil.rmtree(checkpoints / "12")
  stdout, _, resumed = run_example(tmp_path, *flags, "--resume", name="resumed")
  assert "resumed from step 6" in stdout
  assert "checkpoints: 1 saved this run (steps [12]);" in stdout   # the directory holds 2
  assert resumed["checkpoints_kept"] == [6, 12]
  assert resumed["start_step"] == 6
  assert [s for s, _ in resumed["history"]["train"]] == list(range(7, 13))
  np.testing.assert_allclose([l for _, l in resumed["history"]["train"]],
                             [l for _, l in train[6:]], rtol=1e-5)

  # (In this process from here on, to save a start-up.) Another model refuses
  # to resume from these checkpoints.
  with pytest.raises(SystemExit, match=r"--resume: the checkpoint .* holds a model of"):
    train_byte_gpt.main([*SMALL, "--layers", "1", "--d-model", "32", "--steps", "13",
                         "--resume", "--checkpoint-dir", str(checkpoints)])
  # A fresh run in the same directory replaces the earlier checkpoints.
  capsys.readouterr()
  train_byte_gpt.main([*SMALL, "--layers", "1", "--steps", "1", "--checkpoint-dir",
                       str(checkpoints), "--out-dir", str(tmp_path / "fresh")])
  assert "removing 2 checkpoint(s) of an earlier run" in capsys.readouterr().out
  assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["1"]


@pytest.mark.parametrize("flags", [("--dtype", "bfloat16", "--kv-heads", "1"),
                                   ("--fp8", "delayed", "--kv-heads", "2")],
                         ids=["bf16_mqa_replicated", "fp8_gqa_split"])
def test_llama_trains_with_checkpoints(tmp_path, flags):
  """--arch llama (SequenceParallelLlamaBlock: grouped-query attention with its
  key/value heads replicated or split over tp, SwiGLU, rotary embeddings):
  the loss falls, checkpoints are saved, and the report names the block and
  counts the GPT block's all-gathers (gate and up are one gather)."""
  checkpoints = tmp_path / "checkpoints"
  stdout, _, summary = run_example(tmp_path, "--arch", "llama", "--layers", "1", "--steps",
                                   "12", "--checkpoint-every", "6", "--eval-every", "6",
                                   "--checkpoint-dir", str(checkpoints), *flags)
  train, val = summary["history"]["train"], summary["history"]["validation"]
  assert train[-1][1] < 0.9 * train[0][1], train
  assert val[-1][1] < 0.9 * val[0][1], val
  assert summary["sizes"]["kv_heads"] == int(flags[-1])
  assert "SequenceParallelLlamaBlock" in stdout and "MISMATCH" not in stdout
  assert re.search(r"block0: +qkv \S.* gate_up \S.* down ", stdout), stdout
  assert summary["counts"]["standalone_all_gathers"] == summary["expected"][
      "standalone_all_gathers"] == 4
  assert summary["checkpoint_steps"] == [6, 12]


def test_bfloat16_keep_remat_and_the_ab(tmp_path):
  stdout, _, summary = run_example(tmp_path, "--steps", "4", "--dtype", "bfloat16",
                                   "--keep-gathered-input", "--remat", "--no-checkpoint",
                                   "--ab-steps", "2")
  check_report(stdout, summary, layers=2, remat=True)
  assert summary["sizes"]["dtype"] == "bfloat16"
  assert set(summary["ab"]) == {"auto", "xla"}
  assert all(r["tokens_per_s"] > 0 for r in summary["ab"].values())
  assert "auto / xla:" in stdout and "peak: the allocator's high-water mark" in stdout


def test_two_processes(tmp_path):
  stdout, stderr, summary = run_example(tmp_path, "--steps", "3", "--no-checkpoint",
                                        "--processes", "2")
  assert summary["process_count"] == 2 and summary["mesh"] == {"dp": 4, "tp": 2}
  check_report(stdout, summary, layers=2)
  assert stdout.count("layer paths") == 1  # process 0 alone prints
  errors = [line for line in stderr.splitlines()
            if re.search(r"error|traceback|exception", line, re.I)]
  assert not errors, stderr


def test_one_device_trains_on_xla_and_says_why(tmp_path):
  """tp = 1, as on a machine with one GPU (here one CPU device), with
  backend='auto': a group of one has nothing to communicate, so the run
  trains on XLA, skips the tuning and the A/B (even when asked for) with that
  reason, and its report expects no all-gather and counts none."""
  stdout, _, summary = run_example(tmp_path, "--steps", "4", "--no-checkpoint",
                                   "--ab-steps", "2", devices=1)
  reason = ("axis 'tp' has size 1: a group of one has nothing to communicate, so each "
            "layer is a plain GEMM on XLA")
  assert summary["mesh"] == {"dp": 1, "tp": 1}
  train = summary["history"]["train"]
  assert [s for s, _ in train] == [1, 2, 3, 4] and train[-1][1] < 0.97 * train[0][1], train
  assert summary["tokens_per_s"] > 0
  assert f"tp=1: {reason}" in stdout
  skipped = "tp=1: a group of one has nothing to communicate"
  assert f"autotune: skipped ({skipped})" in stdout
  assert summary["autotune"] == {"plan": None, "why": f"skipped: {skipped}"}
  assert f"A/B of backend='auto' against 'xla': skipped ({skipped})" in stdout
  assert "ab" not in summary and summary["ab_skipped"] == skipped
  for i in range(2):
    assert re.search(rf"block{i}: +qkv xla fallback +out-proj xla fallback +gate_up xla "
                     r"fallback +down xla fallback", stdout), stdout
  assert ("qkv, gate_up (column-parallel): xla fallback\n  out-proj, down (row-parallel): xla "
          f"fallback\n  why: {reason}") in stdout, stdout
  assert "MISMATCH" not in stdout
  assert re.search(r"all-gathers in the blocks +counted +0 +expected +0 +ok", stdout), stdout
  assert re.search(r"fused AllGather\+GEMM calls +counted +0 +expected +0 +ok", stdout), stdout
  assert summary["expected"] == {"standalone_all_gathers": 0, "fused_all_gather_matmuls": 0}
  counts = summary["counts"]
  assert (counts["all_gathers_in_step"], counts["reduce_scatters"], counts["all_reduces"],
          counts["fused_all_gather_matmuls"], counts["fused_matmul_reduce_scatters"]) == (
              0, 0, 0, 0, 0), counts
  # XLA's CPU compiler keeps the all-gathers over the group of one (no data
  # moves); they are counted apart and said so.
  assert counts["single_device_collectives"] > 0
  assert "over a group of one device" in stdout


@pytest.mark.filterwarnings("error:.*is not measured:RuntimeWarning")
def test_validation_runs_on_the_routes_autotune_chose(monkeypatch, tmp_path, capsys):
  """With cuBLASMp "available" (the fake extension) and fake timings that make
  the ring fastest, the run tunes its step; autotune_step does not publish its
  choices to the process plan, so the evaluation step (the same problems) must
  run under the tuned step's routes too, or each of its ops would be routed by
  the rule of thumb, with a warning that it is not measured (an error here)."""
  monkeypatch.delenv("JAX_COMM_GEMM_BACKEND", raising=False)
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  monkeypatch.chdir(tmp_path)
  install_fake_native(monkeypatch)
  monkeypatch.setattr(tuning, "time_candidates", lambda runs, rounds, **_: (
      {n: (1e-3 if n == "ring" else 2e-3) for n in runs}))
  summary = train_byte_gpt.main([*SMALL, "--layers", "1", "--tp", "2", "--steps", "2",
                                 "--ab-steps", "0", "--no-checkpoint", "--out-dir",
                                 str(tmp_path)])
  stdout = capsys.readouterr().out
  assert re.search(r"autotune in [\d.]+ s: plan 'ring'", stdout), stdout
  assert summary["autotune"]["plan"] == "ring"
  assert [s for s, _ in summary["history"]["validation"]] == [0, 1, 2]
  # The layer table: the ring, as the tuned step's routes chose for every op
  # (listed, the step's measurement said once), and the ring's counts.
  assert re.search(r"block0: +qkv ring +out-proj ring +gate_up ring +down ring", stdout), stdout
  assert "why: every op chose ring ([1])" in stdout
  assert len(re.findall(r"(all_gather_matmul|matmul_reduce_scatter) rows=.* ring +\[1\]",
                        stdout)) == 8, stdout
  assert stdout.count("(all ring kept)") == 2, stdout  # autotune's line, and the table's [1]
  assert summary["expected"]["standalone_all_gathers"] == summary["counts"][
      "standalone_all_gathers"] == 2 and "MISMATCH" not in stdout


@pytest.mark.parametrize("kept", ["xla", "ring"])
def test_the_layer_table_names_the_path_the_step_compiled_with(monkeypatch, capsys, kept):
  """Ranks sharing a GPU (cuBLASMp refused its workspace) where autotune_step
  kept one implementation for every op: the step makes no fused call, and the
  table names that implementation for every layer and op, from the tuned
  step's routes (not "fused" from the config's backend="auto"), with each
  reason once (not the refusal on every line), and that path's counts."""
  monkeypatch.delenv("JAX_COMM_GEMM_BACKEND", raising=False)
  monkeypatch.setenv("JAX_COMM_GEMM_AUTOTUNE_CACHE", "")
  refusal = "cuBLASMp was refused its workspace (stand-in)"
  install_fake_native(monkeypatch, workspace_error=refusal)
  mesh = train_byte_gpt.make_mesh(2, "cpu")
  jcg.connect(mesh, "tp")
  model = byte_gpt.ByteGPT(byte_gpt.ModelConfig(32, 2, 1, 64, 16), mesh)
  trainer, params, opt_state = byte_gpt.Trainer.create(
      model, byte_gpt.optimizer(1e-3, 2), mesh, seed=0)
  tokens = byte_gpt.to_device(mesh, np.zeros((4, 17), np.uint8))
  args = (params, opt_state, *tokens)
  step = trainer.step_function()
  why = f"step measured: all {kept} 1.000 ms ({kept} kept)"
  routes = current_plan().with_decisions(
      {p: (kept, why) for p in jcg.backends.problems_of(step, *args)})
  tuned = jcg.backends.TunedStep(step, routes, kept, why)
  flags = types.SimpleNamespace(backend="auto", keep_gathered_input=False, remat=False,
                                arch="gpt")
  summary = run_report.layer_report(run_report.program_text(tuned, *args), model.config,
                                    mesh, jnp.float32, flags, 1, print, routes=tuned.routes,
                                    step=step, step_args=args)
  table = capsys.readouterr().out
  paths = table.split("collectives of the compiled")[0]
  path = {"xla": "xla fallback", "ring": "ring"}[kept]
  assert re.search(rf"block0: +qkv {path} +out-proj {path} +fc1 {path} +fc2 {path}\n", table)
  assert (f"qkv, fc1 (column-parallel): {path}\n  out-proj, fc2 (row-parallel): {path}\n"
          f"  why: every op chose {kept} ([1])") in table, table
  assert [op["path"] for op in summary["ops"]] == [kept] * 8, summary["ops"]
  assert {op["role"] for op in summary["ops"]} == {
      f"{kind}-parallel {which}" for kind in ("column", "row") for which in ("forward",
                                                                            "backward")}
  assert table.count(why) == 1 and refusal not in table and "fused" not in paths, table
  assert summary["counts"]["fused_all_gather_matmuls"] == 0
  assert summary["counts"]["standalone_all_gathers"] == summary["expected"][
      "standalone_all_gathers"] == {"xla": 4, "ring": 2}[kept]
  assert "MISMATCH" not in table


def test_each_loss_is_read_after_the_next_step_is_dispatched(monkeypatch, tmp_path, capsys):
  """The loop reads step t's loss (a wait for step t) only after dispatching
  step t + 1, except where it must: before a validation or a checkpoint
  (which see the params after step t; the last step has both). Every step's
  loss is recorded once, in order, with one time per step. (The saves are
  recorded, not written.)"""
  events = []

  class Loss:  # records when the loop turns it into a float
    def __init__(self, step, loss):
      self.step, self.loss = step, loss

    def __float__(self):
      value = float(self.loss)
      events.append(("read", self.step, value))
      return value

  class Step:  # the compiled step, counting its dispatches
    def __init__(self, compiled):
      self.compiled, self.dispatched = compiled, 0

    def __call__(self, *args):
      params, opt_state, loss = self.compiled(*args)
      self.dispatched += 1
      events.append(("dispatch", self.dispatched))
      return params, opt_state, Loss(self.dispatched, loss)

    def __getattr__(self, name):  # as_text etc., for the layer report
      return getattr(self.compiled, name)

  train_step, eval_step = byte_gpt.Trainer.train_step, byte_gpt.Trainer.eval_step
  monkeypatch.setattr(byte_gpt.Trainer, "train_step",
                      lambda self, *a: Step(train_step(self, *a)))

  def recorded_eval_step(self):
    evaluate = eval_step(self)

    def validate(*args):
      events.append(("validate",))
      return evaluate(*args)
    return validate

  monkeypatch.setattr(byte_gpt.Trainer, "eval_step", recorded_eval_step)
  monkeypatch.setattr(byte_gpt, "save", lambda manager, step, *a: events.append(("save", step)))
  times = []
  tokens_per_second = run_report.tokens_per_second

  def recorded_tokens_per_second(step_times, tokens):
    times.extend(step_times)
    return tokens_per_second(step_times, tokens)

  monkeypatch.setattr(run_report, "tokens_per_second", recorded_tokens_per_second)
  summary = train_byte_gpt.main([*SMALL, "--layers", "1", "--steps", "6", "--eval-every", "3",
                                 "--eval-batches", "1", "--checkpoint-every", "5",
                                 "--ab-steps", "0", "--checkpoint-dir", str(tmp_path),
                                 "--out-dir", str(tmp_path)])
  capsys.readouterr()
  order = [e[:2] for e in events]
  d, r = (lambda n: ("dispatch", n)), (lambda n: ("read", n))
  assert order == [("validate",), d(1), d(2), r(1), d(3), r(2), r(3), ("validate",),
                   d(4), d(5), r(4), r(5), ("save", 5), d(6), r(6), ("validate",),
                   ("save", 6)], order
  reads = [e[1:] for e in events if e[0] == "read"]
  assert [tuple(x) for x in summary["history"]["train"]] == reads
  assert [s for s, _ in reads] == [1, 2, 3, 4, 5, 6]
  assert [s for s, _ in summary["history"]["validation"]] == [0, 3, 6]
  assert len(times) == 6 and all(t > 0 for t in times), times


def test_every_option_has_help_and_shows_its_default(capsys):
  parser = train_byte_gpt.build_parser()
  for action in parser._actions:
    if action.help == "==SUPPRESS==" or action.dest == "help":
      continue
    assert action.help, action.option_strings
    assert action.default is not None or "default:" in action.help, action.option_strings
  with pytest.raises(SystemExit):
    parser.parse_args(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  for shown in ("--backend {auto,xla,ring,cublasmp} 'auto': cuBLASMp where it runs",
                "--arch {llama,gpt}", "(default: llama)",
                "(default: auto)", "(default: 128 on CPU, 4096 on GPU)",
                "(default: 1)", "(default: False)", "(default: 250)",
                "(default: 20 on GPU, 0 on CPU, where both run XLA)",
                "(default: 512 (llama 384) on CPU, 16384 (llama 14336) on GPU)",
                "(default: 2 on CPU, 8 on GPU)"):
    assert shown in text, shown


@pytest.mark.parametrize("flags, match", [
    (("--data-dir", "/nonexistent/text"), r"error: text directory /nonexistent/text does "
                                          r"not exist"),
    (("--arch", "gpt", "--heads", "3"), r"error: --heads \(3\) must be a multiple of tp=2"),
    (("--batch", "6"), r"error: --batch \(6\) must be a multiple of dp=4"),
    (("--warmup", "0"), r"error: --warmup \(0\) must be 1 step or more"),
    (("--resume",), r"error: --resume: no checkpoint in .*empty"),
    (("--arch", "llama", "--kv-heads", "3", "--heads", "4"),
     r"error: --kv-heads \(3\) must divide --heads \(4\)"),
    (("--arch", "gpt", "--kv-heads", "1"), r"error: --kv-heads is for --arch llama"),
])
def test_errors(tmp_path, flags, match):
  with pytest.raises(SystemExit, match=match):
    train_byte_gpt.main([*SMALL, "--checkpoint-dir", str(tmp_path / "empty"), *flags])


@pytest.mark.parametrize("warmup", [None, 30])
def test_the_warm_up_grows_geometrically_from_a_hundredth(warmup):
  """Adam's first steps move each weight by about the learning rate: lr / 100
  at the first step, lr / 10 half-way through the warm-up, lr at its end."""
  import optax  # noqa: PLC0415
  lr, steps = 6e-5, 60
  length = warmup or steps // 5
  tx = byte_gpt.optimizer(lr, steps, warmup)
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  moves = []
  for _ in range(length + 1):
    updates, state = tx.update({"w": jnp.ones(4)}, state, params)
    params = optax.apply_updates(params, updates)
    moves.append(float(jnp.abs(updates["w"]).max()))
  np.testing.assert_allclose(moves[0], lr / 100, rtol=1e-3)
  np.testing.assert_allclose(moves[length // 2], lr / 10, rtol=1e-2)
  np.testing.assert_allclose(moves[length], lr, rtol=1e-2)


def test_counts_leave_out_collectives_over_a_group_of_one():
  """A collective whose replica groups hold one device each moves no data: in
  neither written form of the groups is it counted as one (XLA's CPU compiler
  keeps such ops, its GPU compiler drops them)."""
  def op(opcode, groups):
    return (f"  %{opcode}.1 = f32[8,4]{{1,0}} {opcode}(f32[8,4]{{1,0}} %x), channel_id=1, "
            f"replica_groups={groups}, dimensions={{0}}")

  text = "\n".join([op("all-gather", "{{0}}"), op("all-gather", "[8,1]<=[8]"),
                    op("all-gather", "{{0,1},{2,3}}"), op("all-gather-start", "[2,4]<=[8]"),
                    op("all-reduce", "{{0},{1}}"), op("all-reduce", "{}"),
                    op("reduce-scatter", "[4,2]<=[2,4]T(1,0)")])
  counts = hlo.count_collectives(text)
  assert (counts.all_gather, counts.all_reduce, counts.reduce_scatter) == (2, 1, 1)
  assert counts.single_device == 3


@dataclasses.dataclass(frozen=True)
class _FakeCublasMp(CublasMpBackend):
  """The cuBLASMp backend as the report sees it, with a chosen reuse verdict."""
  reuse_ok: bool = True

  def gathered_reuse(self, axis_size, dtype, transpose_w):
    return Capability(self.reuse_ok, "fake verdict")


@pytest.mark.parametrize(
    "backend, reuse_gathered, axis_size, column, keep, row, mlp, block", [
        # fused with reuse: MLP 1 standalone all-gather, 0 with keep; a block twice that.
        (_FakeCublasMp(reuse_ok=True), None, 2, "fused with all_gather", "fused with reuse",
         "fused with reuse", ((1, 2), (0, 2)), ((2, 4), (0, 4))),
        (_FakeCublasMp(reuse_ok=False), None, 2, "fused with all_gather",
         "fused with all_gather", "fused with all_gather", ((2, 2), (2, 2)),
         ((4, 4), (4, 4))),
        (_FakeCublasMp(reuse_ok=True), False, 4, "fused with all_gather",
         "fused with all_gather", "fused with all_gather", ((2, 2), (2, 2)),
         ((4, 4), (4, 4))),
        # A group of one: no collective that moves data, whatever the backend.
        (_FakeCublasMp(reuse_ok=True), None, 1, "xla fallback", "xla fallback",
         "xla fallback", ((0, 0), (0, 0)), ((0, 0), (0, 0))),
        ("xla", None, 1, "xla fallback", "xla fallback", "xla fallback", ((0, 0), (0, 0)),
         ((0, 0), (0, 0))),
        ("auto", None, 1, "xla fallback", "xla fallback", "xla fallback", ((0, 0), (0, 0)),
         ((0, 0), (0, 0))),
        ("xla", None, 2, "xla fallback", "xla fallback", "xla fallback", ((2, 0), (2, 0)),
         ((4, 0), (4, 0))),
    ])
def test_report(monkeypatch, backend, reuse_gathered, axis_size, column, keep, row, mlp,
                block):
  monkeypatch.delenv("JAX_COMM_GEMM_BACKEND", raising=False)
  config = CommGemmConfig(backend=backend, reuse_gathered=reuse_gathered)
  mesh = cpu_mesh(axis_size)
  path = lambda **kw: report.layer_path(config, mesh, "tp", jnp.bfloat16, **kw).path
  assert (path(), path(keep_gathered_input=True), path(reduce_scatter_layer=True)) == (
      column, keep, row)
  expected = lambda keep: dataclasses.astuple(report.expected_all_gathers(
      config, mesh, "tp", jnp.bfloat16, keep_gathered_input=keep))
  assert (expected(False), expected(True)) == mlp
  per_block = lambda keep, remat=False: dataclasses.astuple(
      report.expected_block_all_gathers(config, mesh, "tp", jnp.bfloat16,
                                        keep_gathered_input=keep, remat=remat))
  assert (per_block(False), per_block(True)) == block
  # remat reruns QKV's and fc1's forward: fused where the forward is fused;
  # nothing at all on an axis of size 1.
  (standalone, fused), remat = block[0], per_block(False, remat=True)
  assert remat == ((0, 0) if axis_size == 1 else (standalone, fused + 2) if fused
                   else (standalone + 2, 0))
  if axis_size == 1:
    assert report.layer_path(config, mesh, "tp", jnp.bfloat16).reason == (
        "axis 'tp' has size 1: a group of one has nothing to communicate, so each layer "
        "is a plain GEMM on XLA")
