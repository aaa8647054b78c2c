"""Train a byte-level GPT on the Python standard library's own source files,
built from jax-comm-gemm's sequence-parallel transformer blocks.

The text is every ``*.py`` file of this Python's standard library, read from
disk (``stdlib_bytes.py``: a validation part held out by file, batches that
depend only on the seed and the step). The model is ``byte_gpt.ByteGPT``:
embedding, ``--layers`` blocks over the mesh ``('dp', 'tp')`` (sequence over
``tp``, batch over ``dp``), final norm, tied output layer. The blocks are
Llama's (``--arch llama``, the default: SequenceParallelLlamaBlock, RMSNorm,
SwiGLU, grouped-query attention, rotary embeddings) or GPT-2's (``--arch gpt``:
SequenceParallelTransformerBlock, LayerNorm, GELU, learned positions); llama
is the default because it reaches the GPT block's loss in about half the time
(docs/llama.md). It prints the training and validation loss with tokens/s,
then which path every layer took (cuBLASMp fused with reuse of the gathered
operand, fused plus an all-gather, or the XLA fallback) and why, and the
collectives of the compiled training step next to what the design expects.
With ``--backend auto`` on GPUs it first tunes the step (``jcg.autotune_step``)
and trains with the tuned step, and it ends with an A/B in the same process:
tokens/s and peak device memory with ``backend="auto"`` against
``backend="xla"``. At tp = 1 (one GPU, or ``--tp 1``) a group of one has
nothing to communicate: every layer is a plain GEMM on XLA, and the tuning and
the A/B are skipped, with that reason printed.

  python examples/train_byte_gpt.py                     # CPU: 8 simulated devices, ~2 min
  python examples/train_byte_gpt.py --processes 2       # GPUs: one process per GPU
  python examples/train_byte_gpt.py --resume --steps 600  # continue from the last checkpoint
"""

from __future__ import annotations

import os
import sys

# Simulated devices for CPU runs; the flag only affects the CPU platform, so it
# is harmless on GPUs. It must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_comm_gemm as jcg  # noqa: E402
from jax_comm_gemm.config import REDUCE_SCATTER_IMPLS  # noqa: E402
from jax_comm_gemm.diagnostics import report  # noqa: E402
from jax_comm_gemm.fp8 import Fp8Recipe  # noqa: E402
from jax_comm_gemm.fp8.recipe import GEMM_FORMS  # noqa: E402

import byte_gpt  # noqa: E402
import launch  # noqa: E402
import run_report  # noqa: E402
from stdlib_bytes import ByteCorpus, stdlib_dir  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The GPU preset's head size: what models of this width train with, and the
# largest that cuDNN's fused attention takes.
HEAD_DIM = 128
# Model, batch and run length for each --size. "gpu": a size where the fused
# path matters (GEMMs of 8192 tokens per step per batch of 4); its heads are
# d_model / HEAD_DIM (32 at d_model 4096) and its batch 4 per data-parallel rank.
PRESETS = {
    "cpu": dict(d_model=128, heads=4, layers=2, hidden=512, seq_len=128, batch=16,
                steps=1000, lr=3e-3, warmup=None, dtype="float32"),
    # Adam moves every weight by about lr per step, all in step, so a layer's
    # output moves in proportion to its fan-in: at d_model 4096 and hidden 16384
    # the MLP moves 64 times as far per step as at 512 and 2048. 6e-5 is the
    # 3e-3 that trains smoothly there, scaled by that factor, reached after 40
    # steps of geometric warm-up from 6e-7 (byte_gpt.optimizer): a first step at
    # 5e-6 already made the loss climb (benchmarks/results/2026-12-03_cpu_lr/),
    # and reaching 6e-5 at step 20 (or 4e-5 at 20) spiked it above step 1's
    # (benchmarks/results/2026-12-04_h200/).
    "gpu": dict(d_model=4096, heads=None, layers=4, hidden=16384, seq_len=2048, batch=None,
                steps=60, lr=6e-5, warmup=40, dtype="bfloat16"),
}
# --arch llama's changes to the presets: Llama's SwiGLU hidden widths (about
# 8/3 d_model, of the GPT MLP's 4 d_model) and grouped-query attention. The GPU
# preset is Llama 3 8B's block (d_model 4096, 32 query heads and 8 key/value
# heads of 128, hidden 14336), 4 of them.
LLAMA_PRESETS = {"cpu": dict(hidden=384, kv_heads=2), "gpu": dict(hidden=14336, kv_heads=8)}
SIZE_FIELDS = (*PRESETS["cpu"], "kv_heads")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except where the help text says where it comes from."""

  def _get_help_string(self, action):
    return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
  p.add_argument("--arch", choices=("llama", "gpt"), default="llama",
                 help="the blocks: 'llama' (SequenceParallelLlamaBlock: RMSNorm, SwiGLU, "
                      "grouped-query attention, rotary embeddings, no biases) or 'gpt' "
                      "(SequenceParallelTransformerBlock: LayerNorm, GELU MLP, learned "
                      "positions)")
  size = p.add_argument_group("size (each option overrides its --size preset)")
  size.add_argument("--size", choices=("auto", *PRESETS), default="auto",
                    help="preset: 'cpu' (d_model 128, 2 layers, 1000 steps: about 1.5 min on "
                         "2 cores) or 'gpu' "
                         "(d_model 4096, 32 heads of 128, seq 2048, bf16); 'auto' picks 'gpu' "
                         "when jax's default backend is a GPU")
  for name, kind, what in (("d-model", int, "model width"),
                           ("heads", int, "attention heads in all (a multiple of --tp)"),
                           ("layers", int, "transformer blocks"),
                           ("hidden", int, "MLP hidden width"),
                           ("seq-len", int, "bytes per sequence"),
                           ("batch", int, "sequences per step, global (a multiple of dp)"),
                           ("steps", int, "training steps in all (a resumed run continues "
                                          "up to this step)"),
                           ("lr", float, "peak learning rate (warm-up, then cosine decay)"),
                           ("warmup", int, "steps of geometric warm-up from --lr / "
                                           f"{byte_gpt.WARMUP_FROM:g} to --lr")):
    key = name.replace("-", "_")
    cpu, gpu = PRESETS["cpu"][key], PRESETS["gpu"][key]
    gpu = {"heads": f"d_model / {HEAD_DIM}", "batch": "4 x dp"}.get(key, gpu)
    if key == "hidden":
      cpu, gpu = (f"{PRESETS[z][key]} (llama {LLAMA_PRESETS[z][key]})" for z in ("cpu", "gpu"))
    if key == "warmup":
      cpu = "a fifth of --steps, at most 100"
    size.add_argument(f"--{name}", type=kind, help=f"{what} (default: {cpu} on CPU, {gpu} "
                                                    "on GPU)")
  size.add_argument("--kv-heads", type=int,
                    help="--arch llama's key/value heads, a divisor of --heads (default: "
                         f"{LLAMA_PRESETS['cpu']['kv_heads']} on CPU, "
                         f"{LLAMA_PRESETS['gpu']['kv_heads']} on GPU)")
  size.add_argument("--dtype", choices=tuple(DTYPES),
                    help="computation dtype; parameters stay float32 (default: float32 on "
                         "CPU, bfloat16 on GPU)")
  comm = p.add_argument_group("communication")
  comm.add_argument("--backend", choices=("auto", "xla", "ring", "cublasmp"), default="auto",
                    help="'auto': cuBLASMp where it runs, else XLA's collectives; 'ring': "
                         "per-shard GEMMs and ppermutes that XLA overlaps, on any platform; "
                         "'cublasmp': fail where it cannot run")
  comm.add_argument("--fp8", choices=("tensor", "row", "delayed", "block"),
                    help="run every dense GEMM in FP8 (E4M3 forward, E5M2 gradients) with "
                         "this scaling: one scale per tensor agreed over the tp group, one "
                         "per token row, per tensor from an amax history of 16 steps, or per "
                         "1x128 / 128x128 block (with --fp8-gemm cublaslt on a GPU); FP8 "
                         "bytes are all-gathered (docs/fp8.md) "
                         "(default: none, the GEMMs run in --dtype)")
  comm.add_argument("--fp8-gemm", choices=GEMM_FORMS, default=Fp8Recipe.gemm_form,
                    help="how --fp8 runs its GEMMs: XLA's FP8 GEMM ('direct') or "
                         "the project's cuBLASLt custom call with a timed "
                         "algorithm ('cublaslt'; XLA's where it cannot run) "
                         "(default: %(default)s)")
  comm.add_argument("--keep-gathered-input", action="store_true",
                    help="QKV and fc1 keep their forward's gathered input for the weight "
                         "gradient (no all-gather in the backward pass, more memory)")
  comm.add_argument("--reduce-scatter", choices=REDUCE_SCATTER_IMPLS, default="xla",
                    help="how the cuBLASMp backend runs GEMM+ReduceScatter")
  comm.add_argument("--remat", action="store_true",
                    help="recompute each block's forward in the backward pass (jax.checkpoint)")
  comm.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                    help="jax.nn.dot_product_attention's implementation ('auto': cuDNN's "
                         "fused attention where it runs (a GPU, bfloat16, head size up to "
                         f"{HEAD_DIM}), else XLA's, saying why)")
  comm.add_argument("--tp", type=int,
                    help="tensor-parallel size (default: every GPU; 2 on CPU); the rest of "
                         "the devices is data-parallel. At tp=1 every layer runs on XLA, "
                         "with nothing to communicate")
  comm.add_argument("--processes", type=int, default=1,
                    help="run this many processes joined by jax.distributed on 127.0.0.1, "
                         "one per GPU (on CPU: the 8 simulated devices shared among them)")
  comm.add_argument("--share-gpu", action="store_true",
                    help="with --processes, run every process on GPU 0 (a multi-process check "
                         "on one GPU; its tokens/s measure no speed)")
  comm.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # set by the launcher
  comm.add_argument("--port", type=int, help=argparse.SUPPRESS)
  run = p.add_argument_group("run")
  run.add_argument("--data-dir", default=str(stdlib_dir()),
                   help="directory whose *.py files are the text")
  run.add_argument("--seed", type=int, default=0, help="parameters and batches")
  run.add_argument("--eval-every", type=int, help="steps between validation losses "
                                                  "(default: --steps / 5)")
  run.add_argument("--eval-batches", type=int, default=4,
                   help="validation batches per validation loss")
  run.add_argument("--log-every", type=int,
                   help="steps between progress lines when the output is not a terminal "
                        "(default: --steps / 20); a terminal gets a progress bar")
  run.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "jax-comm-gemm-byte-gpt"),
                   help="where the run writes its loss plot (loss.png), a sample of "
                        "generated text (sample.txt) and, by default, its checkpoints "
                        "(default: %(default)s)")
  run.add_argument("--checkpoint-dir",
                   help="where orbax-checkpoint keeps the last 2 checkpoints (default: "
                        "OUT_DIR/checkpoints); a run without --resume replaces those of an "
                        "earlier run")
  run.add_argument("--sample-bytes", type=int, default=200,
                   help="bytes of text the trained model writes at the end, after a "
                        "prompt from the validation files; 0: none (default: %(default)s)")
  run.add_argument("--checkpoint-every", type=int, default=250,
                   help="steps between checkpoints (and one at the end); 0: only at the end")
  run.add_argument("--no-checkpoint", action="store_true", help="save no checkpoints")
  run.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in --checkpoint-dir")
  run.add_argument("--ab-steps", type=int,
                   help="timed steps per backend and round in the closing A/B of "
                        "backend='auto' against 'xla' (2 rounds, alternating); 0: no A/B; "
                        "none at tp=1, where both run XLA "
                        "(default: 20 on GPU, 0 on CPU, where both run XLA)")
  run.add_argument("--profile", metavar="DIR",
                   help="after training, trace 3 more steps with jax.profiler into DIR, "
                        "run as the loop runs them (one annotation, 'train_steps'; "
                        "benchmarks/trace_summary.py --window train_step summarises "
                        "them), and the step's HLO into "
                        "DIR/step.hlo.txt (benchmarks/producers.py) (default: none)")
  run.add_argument("--json-out", metavar="PATH",
                   help="write a JSON summary here (default: none)")
  return p


def parse_args(argv=None) -> argparse.Namespace:
  p = build_parser()
  args = p.parse_args(argv)
  if args.resume and args.no_checkpoint:
    p.error("--resume needs checkpoints: drop --no-checkpoint")
  if args.sample_bytes < 0:
    p.error(f"--sample-bytes must be 0 or more, not {args.sample_bytes}")
  if args.checkpoint_dir is None:
    args.checkpoint_dir = os.path.join(args.out_dir, "checkpoints")
  return args


def resolve_size(args, platform: str, tp: int, dp: int) -> dict:
  """The run's sizes: the options given, else the preset of --size."""
  size = args.size if args.size != "auto" else ("gpu" if platform == "gpu" else "cpu")
  preset = dict(PRESETS[size], batch=PRESETS[size]["batch"] or 4 * dp, kv_heads=None)
  if args.arch == "llama":
    preset.update(LLAMA_PRESETS[size])
  out = {k: getattr(args, k) if getattr(args, k) is not None else preset[k]
         for k in SIZE_FIELDS}
  if out["heads"] is None:  # the GPU preset: heads of HEAD_DIM of the model width given
    out["heads"] = max(1, out["d_model"] // HEAD_DIM)
  out["size"] = size
  return out


def skip_reasons(args, status, tp: int, platform: str) -> tuple[str | None, str | None]:
  """(why autotuning is skipped, why the closing A/B is skipped), each None
  where it runs. A group of one comes first: with nothing to communicate there
  is nothing to tune or compare, whatever the backend."""
  if tp == 1:
    tune = ab = "tp=1: a group of one has nothing to communicate"
  elif args.fp8:
    tune = ab = ("--fp8: this job does not tune FP8 (each FP8 problem runs on XLA's "
                 "collectives until jax_comm_gemm.backends.autotune measures it against the ring)")
  else:
    tune = (f"--backend {args.backend} chooses no implementation" if args.backend != "auto"
            else None if status.ok else f"cuBLASMp cannot run here: {status.reason}")
    ab = None if _ab_steps(args, platform) > 0 else (
        "--ab-steps 0" if args.ab_steps is not None
        else "on CPU both backends run XLA's collectives; --ab-steps N runs it anyway")
  return tune, ab


def _ab_steps(args, platform: str) -> int:
  return args.ab_steps if args.ab_steps is not None else (20 if platform == "gpu" else 0)


def choose_attention(requested: str, platform: str, dtype, head_dim: int) -> tuple[str, str]:
  """(implementation for jax.nn.dot_product_attention, why). 'auto' takes
  cuDNN's fused attention where it runs, else XLA's; an explicit 'cudnn'
  that cannot run is an error."""
  if requested == "xla":
    return "xla", "XLA's (--attention xla)"
  problem = _cudnn_attention_problem(platform, dtype, head_dim)
  if problem is None:
    return "cudnn", f"cuDNN's fused attention (--attention {requested})"
  if requested == "cudnn":
    raise SystemExit(f"error: --attention cudnn cannot run here: {problem}")
  return "xla", f"XLA's: cuDNN's fused attention cannot run here: {problem}"


def _cudnn_attention_problem(platform: str, dtype, head_dim: int) -> str | None:
  """Why cuDNN's fused attention cannot run this model here, or None: it
  needs a GPU, 16-bit inputs and a head size of a multiple of 8 up to 128,
  and a cuDNN that jax can use (tried on a small causal problem)."""
  if platform != "gpu":
    return f"it needs a GPU, and jax's default backend is {platform!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it needs bfloat16 or float16 inputs, and the model computes in {jnp.dtype(dtype)}"
  if head_dim > HEAD_DIM or head_dim % 8:
    return f"it needs a head size of a multiple of 8 up to {HEAD_DIM}, not {head_dim}"
  q = jnp.zeros((1, 128, 1, head_dim), dtype)
  try:
    jax.block_until_ready(jax.jit(lambda q: jax.nn.dot_product_attention(
        q, q, q, is_causal=True, implementation="cudnn"))(q))
  except Exception as e:  # noqa: BLE001 (any failure means: use XLA's)
    return f"a trial call failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return None


def make_mesh(tp: int | None, platform: str) -> Mesh:
  devices = jax.devices()
  tp = tp or (len(devices) if platform == "gpu" else min(2, len(devices)))
  if tp < 1 or len(devices) % tp:
    raise SystemExit(f"error: --tp={tp} must divide the device count {len(devices)}")
  return Mesh(np.asarray(devices).reshape(len(devices) // tp, tp), ("dp", "tp"))


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.processes > 1 and args.process_id is None:
    raise SystemExit(launch.run_processes(args.processes, __file__,
                                          sys.argv[1:] if argv is None else argv,
                                          share_gpu=args.share_gpu))
  if args.process_id is not None:
    launch.join(args.process_id, args.processes, args.port, share_gpu=args.share_gpu)
  try:
    return train(args)
  finally:
    if args.process_id is not None:
      launch.leave()  # all processes leave together: no error lines at exit


def train(args) -> dict:
  rank0 = jax.process_index() == 0
  say = (lambda *parts: print(*parts, flush=True)) if rank0 else (lambda *parts: None)
  platform = jax.default_backend()
  mesh = make_mesh(args.tp, platform)
  status = jcg.connect(mesh, "tp")  # collective: every process, before the first step
  tp, dp = mesh.shape["tp"], mesh.shape["dp"]
  s = resolve_size(args, platform, tp, dp)
  _check_sizes(s, tp, dp, args.fp8, args.arch)
  model_config = byte_gpt.ModelConfig(s["d_model"], s["heads"], s["layers"], s["hidden"],
                                      s["seq_len"], args.arch, s["kv_heads"])
  try:
    corpus = ByteCorpus(args.data_dir)
  except (OSError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  dtype = DTYPES[s["dtype"]]
  try:  # fail early and plainly where --backend cublasmp cannot run (or with --fp8)
    config = jcg.CommGemmConfig(backend=args.backend, reduce_scatter=args.reduce_scatter,
                                fp8=Fp8Recipe(scaling=args.fp8, gemm_form=args.fp8_gemm)
                                if args.fp8 else None)
    jcg.backends.resolve_backend(config, "tp", mesh)
  except (RuntimeError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  say(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
      f"{jax.process_count()} process(es); mesh dp={dp} tp={tp}; cuBLASMp: {status.reason}")
  say(f"data: {corpus}")
  kv = (f", {s['kv_heads']} key/value heads ("
        + ("split" if s["kv_heads"] % tp == 0 else "replicated") + " over tp)"
        if args.arch == "llama" else "")
  say(f"model ({s['size']} size, {args.arch}): {s['layers']} blocks, d_model {s['d_model']}, "
      f"{s['heads']} heads of {s['d_model'] // s['heads']} ({s['heads'] // tp} per tp shard){kv}, "
      f"hidden {s['hidden']}, seq {s['seq_len']} x batch {s['batch']} = "
      f"{s['seq_len'] * s['batch']:,} tokens/step, {s['dtype']}, backend {args.backend!r}"
      + (f", FP8 GEMMs ({args.fp8} scaling, {args.fp8_gemm})" if args.fp8 else ""))
  attention, attention_why = choose_attention(args.attention, platform, dtype,
                                              s["d_model"] // s["heads"])
  say(f"attention: {attention_why}")
  skip_tuning, skip_ab = skip_reasons(args, status, tp, platform)
  if tp == 1:
    say(f"tp=1: {report.single_device_reason('tp')}")

  model = byte_gpt.ByteGPT(model_config, mesh, dtype, args.keep_gathered_input, args.remat,
                           config, attention)
  trainer, params, opt_state = byte_gpt.Trainer.create(
      model, byte_gpt.optimizer(s["lr"], s["steps"], s["warmup"]), mesh, args.seed)
  say(f"parameters: {sum(a.size for a in jax.tree.leaves(params)):,}")
  checkpoints = run_report.Checkpoints(args, model_config, say)
  start, params, opt_state = checkpoints.start(params, opt_state)

  def batch(part, step):
    return byte_gpt.to_device(mesh, corpus.batch(part, step, batch=s["batch"],
                                                 length=s["seq_len"] + 1, seed=args.seed))

  tokens, targets = batch("train", start)
  if skip_tuning is None:  # the tuned step, jitted with its routes
    step_fn = byte_gpt.autotune(trainer, params, opt_state, tokens, targets, say)
    tuning = {"plan": step_fn.plan, "why": step_fn.why}
  else:
    say(f"autotune: skipped ({skip_tuning})")
    tuning = {"plan": None, "why": f"skipped: {skip_tuning}"}
    t0 = time.perf_counter()
    step_fn = trainer.train_step(params, opt_state, tokens, targets)
    say(f"compiled the training step in {time.perf_counter() - t0:.1f} s")
  evaluate = trainer.eval_step()
  if isinstance(step_fn, jcg.backends.TunedStep):  # validate on the routes autotune chose: its
    # choices are not published to the process plan, so a bare jit would route
    # the eval step's ops (the training step's problems) by the rule of thumb
    evaluate = jcg.backends.TunedStep(evaluate, step_fn.routes, step_fn.plan, step_fn.why)
  val_batches = [batch("validation", i) for i in range(args.eval_batches)]

  def val_loss(params):
    return float(np.mean([evaluate(params, *b) for b in val_batches]))

  eval_every = args.eval_every or max(1, s["steps"] // 5)
  log = run_report.Progress(s["steps"], start, args.log_every or max(1, s["steps"] // 20),
                            s["seq_len"] * s["batch"], rank0)
  history = {"train": [], "validation": [(start, val_loss(params))]}
  log.note(f"step {start}: validation loss {history['validation'][-1][1]:.4f}")
  # Each step's loss is read one step late, after the next step is dispatched
  # and its batch built: a read waits for its step, and waiting before the next
  # dispatch would leave the devices idle while the host launches that step.
  # Validation and checkpoints read the pending loss first, so the log stays in
  # step order. A step's time runs from the previous read (or its dispatch, if
  # later) to its own read: the device's step time, and the first step's holds
  # its warm-up (tokens_per_second leaves it out).
  times, pending, last_read = [], None, 0.0

  def read_pending():
    nonlocal pending, last_read
    if pending is not None:
      done, loss, dispatched = pending
      history["train"].append((done, float(loss)))
      now = time.perf_counter()
      times.append(now - max(dispatched, last_read))
      pending, last_read = None, now
      log.step(done, history["train"][-1][1], times[-1])

  for step in range(start, s["steps"]):
    t = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, tokens, targets)
    if step + 1 < s["steps"]:  # built on the host while the devices run the step
      tokens, targets = batch("train", step + 1)
    read_pending()  # the previous step's
    pending = (step + 1, loss, t)
    validate = (step + 1) % eval_every == 0 or step + 1 == s["steps"]
    if validate or checkpoints.due(step + 1, s["steps"]):
      read_pending()
    if validate:
      history["validation"].append((step + 1, val_loss(params)))
      log.note(f"step {step + 1}: validation loss {history['validation'][-1][1]:.4f}")
    checkpoints.maybe_save(step + 1, s["steps"], params, opt_state)
  read_pending()  # the last step always validates, so none is left: a guard
  log.close()
  checkpoints.close()
  if args.profile:  # 3 more steps as the loop runs them (they update the model too):
    # each loss read after the next step is dispatched and its batch built, so
    # the trace shows the device's idle time between steps as training has it
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      with jax.profiler.TraceAnnotation("train_steps"):
        previous = None
        for i in range(3):
          params, opt_state, loss = step_fn(params, opt_state, tokens, targets)
          tokens, targets = batch("train", s["steps"] + i + 1)
          if previous is not None:
            float(previous)
          previous = loss
        float(previous)
    say(f"profile: 3 steps traced into {args.profile}")
  tokens_per_s = run_report.tokens_per_second(times, s["seq_len"] * s["batch"])
  say(run_report.loss_summary(history, tokens_per_s, start))
  outputs = show_results(args, s, history, trainer, step_fn, params, mesh, corpus, say,
                         rank0)
  say(checkpoints.where())
  if args.share_gpu:
    say("(--share-gpu: the processes share one GPU, so tokens/s is not a speed measurement)")

  step_text = run_report.program_text(step_fn, params, opt_state, tokens, targets)
  if args.profile and rank0:  # beside the trace: benchmarks/producers.py joins the two
    with open(os.path.join(args.profile, "step.hlo.txt"), "w") as f:
      f.write(step_text)
  # The paths from the routes the step was compiled under: the tuned step's,
  # else the process plan's (nothing has been published since the compile).
  summary = run_report.layer_report(step_text, config, mesh, dtype, args, s["layers"], say,
                                    routes=getattr(step_fn, "routes", None),
                                    step=trainer.step_function(),
                                    step_args=(params, opt_state, tokens, targets))
  summary.update(history=history, tokens_per_s=tokens_per_s, start_step=start,
                 final_step=max(start, s["steps"]), sizes=s, mesh={"dp": dp, "tp": tp},
                 platform=platform, process_count=jax.process_count(),
                 checkpoint_steps=checkpoints.saved, checkpoints_kept=checkpoints.kept,
                 outputs=outputs, jax_version=jax.__version__,
                 autotune=tuning, attention={"implementation": attention,
                                             "why": attention_why})
  if skip_ab is None:
    summary["ab"] = run_report.ab_test(trainer, params, opt_state, _ab_steps(args, platform),
                                       config, lambda i: batch("train", s["steps"] + i),
                                       s["seq_len"] * s["batch"], say, trained_step=step_fn)
  else:
    say(f"A/B of backend='auto' against 'xla': skipped ({skip_ab})")
    summary["ab_skipped"] = skip_ab
  if args.json_out and rank0:
    with open(args.json_out, "w") as f:
      json.dump(summary, f, indent=2, default=str)
  return summary


def show_results(args, s, history, trainer, step_fn, params, mesh, corpus, say,
                 rank0: bool) -> dict:
  """The loss plot and a sample of generated text, in --out-dir (process 0
  writes them; sampling is collective). Returns their paths."""
  out = os.path.abspath(args.out_dir)
  outputs = {}
  if rank0:
    os.makedirs(out, exist_ok=True)
    outputs["plot"] = os.path.join(out, "loss.png")
    run_report.plot_losses(history, outputs["plot"],
                           f"byte {args.arch}, {s['layers']} blocks, d_model {s['d_model']}, "
                           f"backend {args.backend}" + (f", FP8 {args.fp8}" if args.fp8 else ""))
    say(f"loss plot: {outputs['plot']}")
  if args.sample_bytes:
    next_logits = trainer.next_byte_logits()
    if isinstance(step_fn, jcg.backends.TunedStep):  # on the routes autotune chose (as evaluate)
      next_logits = jcg.backends.TunedStep(next_logits, step_fn.routes, step_fn.plan, step_fn.why)
    prompt = bytes(corpus.batch("validation", 0, batch=1, length=s["seq_len"] // 2,
                                seed=args.seed)[0])
    text = byte_gpt.sample(next_logits, params, mesh, prompt, args.sample_bytes,
                           s["seq_len"], seed=args.seed)
    if rank0:
      outputs["sample"] = os.path.join(out, "sample.txt")
      with open(outputs["sample"], "wb") as f:
        f.write(prompt + b"\n--- the model's continuation ---\n" + text + b"\n")
      shown = "".join(c if c.isprintable() or c in "\n\t" else "\ufffd"
                      for c in text.decode("utf-8", "replace"))
      say(f"sample ({args.sample_bytes} bytes after a {len(prompt)}-byte prompt from the "
          f"validation files; both in {outputs['sample']}):\n{shown}\n---")
  return outputs


def _check_sizes(s, tp: int, dp: int, fp8: str | None, arch: str) -> None:
  problems = []
  kv = s.get("kv_heads")
  if arch != "llama" and kv is not None:
    problems.append("--kv-heads is for --arch llama (the gpt blocks' heads are all "
                    "key/value heads)")
  if arch == "llama":
    if kv is None or kv < 1 or s["heads"] % kv:
      problems.append(f"--kv-heads ({kv}) must divide --heads ({s['heads']})")
    elif s["d_model"] % s["heads"] == 0 and (s["d_model"] // s["heads"]) % 2:
      problems.append(f"--d-model / --heads ({s['d_model'] // s['heads']}) must be even: "
                      "rotary embeddings rotate pairs of features")
  if fp8 == "block":  # every GEMM dim, per tp shard, in blocks of 128
    dims = {"--d-model / tp": s["d_model"] // tp, "--hidden / tp": s["hidden"] // tp,
            "--d-model": s["d_model"], "--seq-len x --batch / dp": s["seq_len"] * s["batch"] // dp}
    if arch == "llama" and kv and s["heads"] % kv == 0 and s["d_model"] % s["heads"] == 0:
      dims["2 x --kv-heads (/ tp where it divides) x head size"] = (
          2 * (kv // tp if kv % tp == 0 else kv) * (s["d_model"] // s["heads"]))
    problems += [f"--fp8 block needs {name} ({value}) to be a multiple of 128"
                 for name, value in dims.items() if value % 128]
  if s["heads"] % tp:
    problems.append(f"--heads ({s['heads']}) must be a multiple of tp={tp}")
  if s["d_model"] % s["heads"]:
    problems.append(f"--d-model ({s['d_model']}) must divide into --heads ({s['heads']})")
  if s["hidden"] % tp:
    problems.append(f"--hidden ({s['hidden']}) must be a multiple of tp={tp}")
  if s["seq_len"] % tp:
    problems.append(f"--seq-len ({s['seq_len']}) must be a multiple of tp={tp}")
  if s["batch"] % dp:
    problems.append(f"--batch ({s['batch']}) must be a multiple of dp={dp}")
  if s["warmup"] is not None and s["warmup"] < 1:
    problems.append(f"--warmup ({s['warmup']}) must be 1 step or more")
  if problems:
    raise SystemExit("error: " + "; ".join(problems))


if __name__ == "__main__":
  main()
