"""What train_byte_gpt.py prints and keeps: progress, checkpoints, the layer
path report with the collectives of the compiled step, and the GPU A/B."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time
import warnings

import jax
from tqdm import tqdm

import jax_comm_gemm as jcg
from jax_comm_gemm import hlo
from jax_comm_gemm.backends import choose_backend
from jax_comm_gemm.backends.routes import fp8_route
from jax_comm_gemm.diagnostics import report
from jax_comm_gemm.layers import llama, transformer
from jax_comm_gemm.runtime import plan as plan_lib
from jax_comm_gemm.runtime.registry import current_plan

import byte_gpt


# --- progress ------------------------------------------------------------------------

class Progress:
  """A tqdm bar on a terminal; elsewhere (a log file, CI) a line every `every`
  steps, since a bar's carriage returns pile up on one line there."""

  def __init__(self, total: int, start: int, every: int, tokens_per_step: int,
               enabled: bool):
    self.total, self.every, self.tokens = total, every, tokens_per_step
    self.enabled = enabled
    self.bar = (tqdm(total=total, initial=start, ncols=100, mininterval=0.5,
                     file=sys.stdout) if enabled and _terminal() else None)
    self.started, self.done = time.perf_counter(), 0

  def step(self, step: int, loss: float, seconds: float) -> None:
    self.done += 1
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.tokens / seconds:,.0f}",
                           refresh=False)
    elif self.enabled and (step % self.every == 0 or step == self.total):
      elapsed = time.perf_counter() - self.started
      eta = elapsed / self.done * (self.total - step)
      print(f"step {step:>6}/{self.total}  loss {loss:.4f}  "
            f"{self.tokens / seconds:>10,.0f} tokens/s  elapsed {elapsed:5.0f} s  "
            f"eta {eta:5.0f} s", flush=True)

  def note(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    elif self.enabled:
      print(text, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _terminal() -> bool:
  """A terminal that can show a bar (tqdm hides it where the size is 0 x 0)."""
  try:
    return sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).lines > 0
  except (OSError, ValueError):
    return False


def tokens_per_second(times: list[float], tokens_per_step: int) -> float:
  """Leaves the run's first step out: it holds one-off allocation and warm-up."""
  steady = times[1:] or times
  return tokens_per_step * len(steady) / sum(steady) if steady else 0.0


def loss_summary(history: dict, tokens_per_s: float, start: int) -> str:
  train, val = history["train"], history["validation"]
  parts = []
  if train:
    parts.append(f"train loss {train[0][1]:.4f} (step {train[0][0]}) -> {train[-1][1]:.4f} "
                 f"(step {train[-1][0]})")
  parts.append(f"validation loss {val[0][1]:.4f} (step {val[0][0]}) -> {val[-1][1]:.4f} "
               f"(step {val[-1][0]})")
  if train:
    parts.append(f"{tokens_per_s:,.0f} tokens/s")
  else:
    parts.append(f"nothing to train: the run was already at step {start}")
  return "; ".join(parts)


def plot_losses(history: dict, path: pathlib.Path, title: str) -> None:
  """The training and validation losses against the step, as a PNG."""
  import matplotlib  # noqa: PLC0415 (only the end of a run needs it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4))
  for name, points, style in (("training", history["train"], "-"),
                              ("validation", history["validation"], "o-")):
    if points:
      ax.plot([s for s, _ in points], [v for _, v in points], style, label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per byte)")
  ax.set_title(title, fontsize=9)
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --- checkpoints ---------------------------------------------------------------------

class Checkpoints:
  """orbax-checkpoint in --checkpoint-dir: every --checkpoint-every steps and at
  the end; --resume restores the last one."""

  def __init__(self, args, model_config, say):
    self.enabled, self.resume, self.every = not args.no_checkpoint, args.resume, \
        args.checkpoint_every
    self.dir = pathlib.Path(args.checkpoint_dir).absolute()
    self.meta = {"model": dataclasses.asdict(model_config), "seed": args.seed}
    self.say, self.saved, self.kept = say, [], []
    self.manager = byte_gpt.checkpoint_manager(self.dir) if self.enabled else None

  def start(self, params, opt_state):
    """(first step, params, opt_state): restored with --resume, else as given
    (earlier checkpoints in the directory are removed)."""
    if not self.enabled:
      return 0, params, opt_state
    steps = self.manager.all_steps()
    if not self.resume:
      if steps:
        self.say(f"a fresh run: removing {len(steps)} checkpoint(s) of an earlier run in "
                 f"{self.dir} (--resume continues them)")
        for step in steps:
          self.manager.delete(step)
      return 0, params, opt_state
    if not steps:
      self._fail(f"error: --resume: no checkpoint in {self.dir}")
    step = self.manager.latest_step()
    meta = byte_gpt.restore_meta(self.manager, step)
    if meta.get("model") != self.meta["model"]:
      self._fail(f"error: --resume: the checkpoint in {self.dir} holds a model of "
                 f"{meta.get('model')}, this run builds {self.meta['model']}: give the "
                 "same sizes, or another --checkpoint-dir")
    params, opt_state = byte_gpt.restore(self.manager, step, params, opt_state)
    self.say(f"resumed from step {step} ({self.dir})")
    return step, params, opt_state

  def _fail(self, message: str):
    self.manager.close()  # its threads would outlive the error otherwise
    raise SystemExit(message)

  def due(self, step: int, total: int) -> bool:
    """Whether `maybe_save` saves at `step`."""
    return self.enabled and (step == total or bool(self.every and step % self.every == 0))

  def maybe_save(self, step: int, total: int, params, opt_state) -> None:
    if self.due(step, total):
      byte_gpt.save(self.manager, step, params, opt_state, dict(self.meta, step=step))
      self.saved.append(step)

  def close(self) -> None:
    """Waits for the saves; `kept` is then what the directory holds (orbax
    keeps the last 2 of those saved)."""
    if self.manager is not None:
      self.manager.wait_until_finished()
      self.kept = sorted(self.manager.all_steps())
      self.manager.close()

  def where(self) -> str:
    if not self.enabled:
      return "checkpoints: none (--no-checkpoint)"
    if not self.saved:
      return f"checkpoints: none saved this run; {self.dir} holds steps {self.kept}"
    return (f"checkpoints: {len(self.saved)} saved this run (steps {self.saved}); {self.dir} "
            f"holds the last {len(self.kept)} (steps {self.kept}; --resume continues)")


# --- the layer report ----------------------------------------------------------------

# The layers of each kind in a block.
# The Llama block's gated MLP: gate and up are one column-parallel op (fc1's
# place), down the row-parallel one (fc2's); so its counts are the GPT block's.
MLP_NAMES = {"gpt": ("fc1", "fc2"), "llama": ("gate_up", "down")}

def program_text(step_fn, *args) -> str:
  """The HLO of the compiled training step: an ahead-of-time compiled step's
  own, or a jitted one's (autotune_step's tuned step) compiled for `args`."""
  return _compiled(step_fn, *args).as_text()


def _compiled(step_fn, *args):
  return step_fn if hasattr(step_fn, "as_text") else step_fn.lower(*args).compile()


def layer_report(step_text: str, config, mesh, dtype, args, layers: int, say,
                 routes=None, step=None, step_args=()) -> dict:
  """Prints and returns the path of every layer, why, and the collectives of
  the compiled training step (its HLO, `step_text`): counted inside the
  blocks, and expected (``diagnostics.report``, for every tp). The paths come
  from `routes`, the routing plan the step was compiled under (a tuned step's
  ``routes``; default: the plan in force). Where ``backend="auto"`` chooses
  per op, each op of `step(*step_args)` (the step's function, traced again)
  is listed with the implementation those routes chose, and the layers'
  paths and counts are that implementation's where every op chose the same
  plain one (XLA or the ring). Each reason is said once."""
  arch = args.arch
  fc1, fc2 = MLP_NAMES[arch]
  column_label, row_label = f"qkv, {fc1} (column-parallel)", f"out-proj, {fc2} (row-parallel)"
  routes = current_plan() if routes is None else routes
  with plan_lib.use(routes):  # the decisions the step was compiled with
    fp8 = fp8_route(config, routes)
    per_op = mesh.shape["tp"] > 1 and (
        fp8.backend == "auto" if fp8.fp8 else
        isinstance(choose_backend(config, "tp", mesh).backend, jcg.backends.AutoBackend))
  ops = report.op_paths(config, routes, step, *step_args) if per_op and step else []
  notes = {}  # each reason of the ops once, numbered
  for op in ops:
    notes.setdefault(op.why, len(notes) + 1)
  chosen = list(dict.fromkeys(op.implementation for op in ops))
  # The config whose layer-level paths and counts are the step's: the one
  # plain implementation every op chose, if so; none where ops differ or fuse.
  effective = (config if not per_op else
               dataclasses.replace(config, backend=chosen[0])
               if len(chosen) == 1 and chosen[0] in ("xla", "ring") else None)
  say(f"layer paths (backend {args.backend!r}, tp={mesh.shape['tp']}, "
      f"{jax.numpy.dtype(dtype)}, {'SequenceParallelLlamaBlock' if arch == 'llama' else 'SequenceParallelTransformerBlock'})" + (": each op as routed for its shape" if per_op else ""))
  paths, expected = {}, None
  if effective is not None:
    with plan_lib.use(routes), warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # the config's, said at its first use
      column = report.layer_path(effective, mesh, "tp", dtype,
                                 keep_gathered_input=args.keep_gathered_input)
      row = report.layer_path(effective, mesh, "tp", dtype, reduce_scatter_layer=True)
      block = report.expected_block_all_gathers(effective, mesh, "tp", dtype,
                                                keep_gathered_input=args.keep_gathered_input,
                                                remat=args.remat)
    for i in range(layers):
      say(f"  block{i}:  qkv {column.path:<22} out-proj {row.path:<22} "
          f"{fc1} {column.path:<22} {fc2} {row.path}")
    if per_op:  # why: the ops' reasons, below (and FP8's recipe, on that path)
      why = f"every op chose {chosen[0]} ({', '.join(f'[{n}]' for n in notes.values())})"
      reasons = [why + (f": {column.reason}" if fp8.fp8 else "")] * 2
    else:
      reasons = [column.reason, row.reason]
    if reasons[0] == reasons[1]:
      say(f"  {column_label}: {column.path}\n  {row_label}: {row.path}\n  why: {reasons[0]}")
    else:
      say(f"  {column_label}: {column.path} ({reasons[0]})\n  {row_label}: {row.path} ({reasons[1]})")
    paths = {"column_parallel": {"path": column.path, "reason": reasons[0]},
             "row_parallel": {"path": row.path, "reason": reasons[1]}}
    expected = {"standalone_all_gathers": layers * block.standalone_all_gathers,
                "fused_all_gather_matmuls": layers * block.fused_all_gather_matmuls}
  elif per_op:  # ops of a kind differ, or fuse: each kind's implementations
    for name, kind, label in (("column_parallel", column_label, "column"),
                              ("row_parallel", row_label, "row")):
      passes = {}
      for op in ops:
        if op.role.startswith(label):
          passes.setdefault(op.role.split(" ", 1)[1], []).append(op.implementation)
      text = "; ".join(f"{which} {', '.join(dict.fromkeys(names))}"
                       for which, names in passes.items()) or "no op chosen per shape"
      say(f"  {kind}: {text}")
      paths[name] = {"path": text, "reason": "as routed per op"}
  if per_op:
    say(f"  each op of the step (op, local shape, dtype, transpose, group size), in blocks "
        f"0-{layers - 1}:")
    for op in ops:
      say(f"    {op.problem.text():<58} {op.implementation:<20} [{notes[op.why]}]")
    for why, number in notes.items():
      say(f"  [{number}] {why}")

  total = hlo.count_collectives(step_text)
  blocks = hlo.count_collectives(step_text, llama.SCOPE if arch == "llama" else transformer.SCOPE)
  got = {"standalone_all_gathers": blocks.all_gather,
         "fused_all_gather_matmuls": total.fused_all_gather_matmul}
  say(f"collectives of the compiled training step (forward + backward, {layers} blocks):")
  for key, label in (("standalone_all_gathers", "all-gathers in the blocks"),
                     ("fused_all_gather_matmuls", "fused AllGather+GEMM calls")):
    if expected is None:
      say(f"  {label:<30} counted {got[key]:>3}   (as routed per op, above)")
      continue
    verdict = "ok" if got[key] == expected[key] else "MISMATCH"
    say(f"  {label:<30} counted {got[key]:>3}   expected {expected[key]:>3}  {verdict}")
  say(f"  {'all-gathers in the whole step':<30} counted {total.all_gather:>3}")
  say(f"  {'reduce-scatters (XLA)':<30} counted {total.reduce_scatter:>3}")
  say(f"  {'fused GEMM+ReduceScatter calls':<30} counted {total.fused_matmul_reduce_scatter:>3}")
  say(f"  {'all-reduces':<30} counted {total.all_reduce:>3}")
  if total.single_device:
    say(f"  {'over a group of one device':<30} counted {total.single_device:>3}   (they move no "
        "data: not in the counts above)")
  return {"paths": paths,
          "ops": [{"op": op.problem.text(), "role": op.role, "path": op.implementation,
                   "why": op.why} for op in ops],
          "counts": {**got, "all_gathers_in_step": total.all_gather,
                     "reduce_scatters": total.reduce_scatter,
                     "fused_matmul_reduce_scatters": total.fused_matmul_reduce_scatter,
                     "all_reduces": total.all_reduce,
                     "single_device_collectives": total.single_device},
          "expected": expected}


# --- the A/B on GPUs -----------------------------------------------------------------

def ab_test(trainer, params, opt_state, steps, config, make_batch, tokens_per_step, say,
            trained_step=None, rounds: int = 2) -> dict:
  """Tokens/s and memory of the training step with backend="auto" against
  backend="xla", in this process, from the trained state (both continue
  training). Each program runs 2 warm-up steps (auto first, then xla: the
  memory is read after each); then `rounds` times `steps` timed steps of
  each, auto first in even rounds and xla first in odd ones, so that a drift
  (clocks, heat) touches both alike. The
  batches are on the devices before the clock starts; each phase is timed as a
  whole, with one wait at its end. Where a backend's step makes fused calls,
  the result also says how many a step makes and the host time each takes
  (REGISTRY.call_counters over its timed steps). `trained_step` (the training
  run's compiled step) serves its own backend."""
  backends = ("auto", "xla")
  batches = iter([make_batch(i) for i in range(2 * len(backends) * (1 + rounds * steps))])
  say(f"A/B: {rounds} rounds of {steps} timed steps per backend, after 2 warm-up steps")
  programs, results = {}, {}
  for backend in backends:
    cfg = dataclasses.replace(config, backend=backend)
    ab = trainer.with_config(dataclasses.replace(trainer.model, config=cfg))
    first = next(batches)
    step_fn = (trained_step if trained_step is not None and backend == config.backend
               else ab.train_step(params, opt_state, *first))
    for b in (first, next(batches)):
      params, opt_state, loss = step_fn(params, opt_state, *b)
    jax.block_until_ready((params, loss))
    programs[backend] = step_fn
    plan = _compiled(step_fn, params, opt_state, *first).memory_analysis()
    planned = 0 if plan is None else (plan.argument_size_in_bytes + plan.output_size_in_bytes
                                      + plan.temp_size_in_bytes - plan.alias_size_in_bytes)
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    results[backend] = {
        "path": report.layer_path(cfg, trainer.mesh, "tp", trainer.model.dtype,
                                  reduce_scatter_layer=True).path,
        "seconds": 0.0,
        "peak_bytes_in_use": max(s.get("peak_bytes_in_use", 0) for s in stats),
        "xla_planned_bytes": planned,
        "cublasmp_workspace_bytes": max((c.get("workspace_bytes", 0)
                                         for c in jcg.runtime.REGISTRY.contexts()), default=0)}
  counted = {backend: None for backend in backends}  # the fused calls of its timed steps
  for r in range(rounds):
    # ABBA: whichever runs first in a round would carry any drift alone (with
    # the same choices as xla, auto has measured 3% behind it when always first).
    for backend in (backends if r % 2 == 0 else backends[::-1]):
      timed = [next(batches) for _ in range(steps)]
      before = jcg.runtime.REGISTRY.call_counters()
      start = time.perf_counter()
      for b in timed:
        params, opt_state, loss = programs[backend](params, opt_state, *b)
      jax.block_until_ready((params, loss))
      results[backend]["seconds"] += time.perf_counter() - start
      span = jcg.runtime.REGISTRY.call_counters() - before
      counted[backend] = span if counted[backend] is None else counted[backend] + span
  for backend in backends:
    r = results[backend]
    r["tokens_per_s"] = tokens_per_step * rounds * steps / r["seconds"]
    if counted[backend] is not None and counted[backend].calls > 0:  # per GPU
      r["fused_calls_per_step"] = counted[backend].calls / max(1, counted[backend].contexts) / (
          rounds * steps)
      r["host_us_per_fused_call"] = round(counted[backend].host_us_per_call(), 1)
    say(f"  backend={backend!r:<7} ({r['path']}): {r['tokens_per_s']:>10,.0f} tokens/s   "
        f"peak {_gib(r['peak_bytes_in_use'])}   XLA plan {_gib(r['xla_planned_bytes'])}   "
        f"cuBLASMp workspace {_gib(r['cublasmp_workspace_bytes'])}"
        + (f"   {r['fused_calls_per_step']:g} fused calls a step, "
           f"{r['host_us_per_fused_call']:.0f} us of host time each"
           if "host_us_per_fused_call" in r else ""))
  auto, xla = results["auto"], results["xla"]
  say(f"  auto / xla: {auto['tokens_per_s'] / xla['tokens_per_s']:.3f}x tokens/s; XLA plan "
      f"{(auto['xla_planned_bytes'] - xla['xla_planned_bytes']) / 2**20:+,.0f} MiB")
  say("  peak: the allocator's high-water mark, Device.memory_stats()['peak_bytes_in_use'],\n"
      "    the largest over this process's devices. It never falls within a process, so\n"
      "    'xla' (read after 'auto') shows max(training, auto, xla).\n"
      "  XLA plan: XLA's buffer assignment for one step, per device (arguments + outputs +\n"
      "    temporaries - donated). cuBLASMp's workspace lies outside XLA's allocator.")
  return results


def _gib(n: int) -> str:
  return f"{n / 2**30:7.2f} GiB" if n else "    n/a"
