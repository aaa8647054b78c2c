"""Train a stack of sequence-parallel MLP blocks with jax-comm-gemm's Flax modules.

The model is ``L`` residual blocks ``x + SequenceParallelMLP(LayerNorm(x))``
(linen), trained with AdamW to match a fixed random "teacher" of the same kind
on fresh synthetic tokens every step, so the loss visibly falls. The mesh is
``('dp', 'tp')``: tokens are sharded over both axes between layers, the MLP
weights over ``tp``.

At the end it reports, per block, which path each layer ran (cuBLASMp fused
with reuse of the gathered operand, fused plus an all-gather, or the XLA
fallback), and the collectives counted in the compiled training step next to
what the design expects.

Runs as is on a CPU (8 simulated devices) or on GPUs::

  python examples/train_sp_mlp.py                    # defaults: < 1 min on a CPU
  python examples/train_sp_mlp.py --dtype bfloat16 --d-model 4096 --d-ff 16384 \\
      --tokens 16384 --layers 8 --steps 200          # on GPUs

Several processes (one per GPU or host) join with ``--coordinator HOST:PORT
--num-processes N --process-id I`` or the environment variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
"""

from __future__ import annotations

import os

# Simulated devices for CPU runs; the flag only affects the CPU platform, so it
# is harmless on GPUs. It must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_comm_gemm as jcg  # noqa: E402
from jax_comm_gemm import CommGemmConfig, hlo, resolve_backend  # noqa: E402
from jax_comm_gemm.diagnostics import report  # noqa: E402
from jax_comm_gemm.config import REDUCE_SCATTER_IMPLS  # noqa: E402
from jax_comm_gemm.linen import SequenceParallelMLP  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--layers", type=int, default=4, help="residual MLP blocks")
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--d-ff", type=int, default=512)
  p.add_argument("--tokens", type=int, default=512, help="tokens per step (global)")
  p.add_argument("--tp", type=int, default=None,
                 help="tensor-parallel size (default: 2, or the device count if smaller)")
  p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                 help="computation dtype (parameters stay float32)")
  p.add_argument("--keep-gathered-input", action="store_true",
                 help="fc1 keeps its forward's gathered input for the weight gradient")
  p.add_argument("--backend", choices=("auto", "xla", "cublasmp"), default="auto")
  p.add_argument("--reduce-scatter", choices=REDUCE_SCATTER_IMPLS, default="xla",
                 help="how the cuBLASMp backend runs GEMM+ReduceScatter")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json-out", metavar="PATH", help="write a JSON summary here")
  p.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                 help="HOST:PORT of process 0, to join several processes")
  p.add_argument("--num-processes", type=int,
                 default=_env_int("JAX_NUM_PROCESSES"))
  p.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
  return p.parse_args(argv)


def _env_int(name):
  value = os.environ.get(name)
  return int(value) if value else None


class Block(nn.Module):
  """``x + MLP(LayerNorm(x))``, the MLP sequence-parallel over 'tp'."""

  d_ff: int
  mesh: Mesh
  dtype: jnp.dtype
  keep_gathered_input: bool
  config: CommGemmConfig

  @nn.compact
  def __call__(self, x):
    # LayerNorm works per token, so it needs no communication on token shards.
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = SequenceParallelMLP(self.d_ff, mesh=self.mesh, axis_name="tp",
                            data_axes=("dp",), dtype=self.dtype,
                            keep_gathered_input=self.keep_gathered_input,
                            config=self.config, name="mlp")(h)
    return x + h.astype(x.dtype)


class Stack(nn.Module):
  layers: int
  d_ff: int
  mesh: Mesh
  dtype: jnp.dtype = jnp.float32
  keep_gathered_input: bool = False
  config: CommGemmConfig = CommGemmConfig()

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = Block(self.d_ff, self.mesh, self.dtype, self.keep_gathered_input,
                self.config, name=f"block{i}")(x)
    return x


def make_mesh(tp: int | None) -> Mesh:
  devices = jax.devices()
  tp = tp or min(2, len(devices))
  if tp < 1 or len(devices) % tp:
    raise SystemExit(f"--tp={tp} must divide the device count {len(devices)}")
  return Mesh(np.asarray(devices).reshape(len(devices) // tp, tp), ("dp", "tp"))


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.coordinator:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  rank0 = jax.process_index() == 0

  def say(*parts):
    if rank0:
      print(*parts, flush=True)

  mesh = make_mesh(args.tp)
  tp = mesh.shape["tp"]
  jcg.connect(mesh, "tp")  # collective: every process, before the first step
  if args.tokens % mesh.size or args.d_ff % tp:
    raise SystemExit(f"--tokens ({args.tokens}) must divide by the {mesh.size} "
                     f"devices and --d-ff ({args.d_ff}) by tp={tp}")
  dtype = DTYPES[args.dtype]
  config = CommGemmConfig(backend=args.backend, reduce_scatter=args.reduce_scatter)
  try:  # fail early and plainly where --backend cublasmp cannot run
    backend = resolve_backend(config)
  except RuntimeError as e:
    raise SystemExit(f"error: {e}") from None
  model = Stack(args.layers, args.d_ff, mesh, dtype, args.keep_gathered_input, config)
  tokens = NamedSharding(mesh, P(("dp", "tp")))
  replicated = NamedSharding(mesh, P())
  say(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
      f"{jax.process_count()} process(es); mesh dp={mesh.shape['dp']} tp={tp}; "
      f"{args.layers} blocks, d_model {args.d_model}, d_ff {args.d_ff}, "
      f"{args.tokens} tokens/step, {args.dtype}, {backend.name} backend")

  # The teacher: the same kind of stack, with its own fixed random weights. It
  # only makes data, so it runs on plain XLA whatever --backend says.
  key_teacher, key_init, key_data = jax.random.split(jax.random.key(args.seed), 3)
  teacher = Stack(args.layers, args.d_ff, mesh, jnp.float32, False,
                  CommGemmConfig(backend="xla"))
  shape = (args.tokens, args.d_model)

  # Parameters and optimizer state are created sharded as their partitioning
  # metadata says (kernels and fc1 biases over 'tp', the rest replicated).
  # Every array is made inside jit, so that this also holds with several processes.
  def init_sharded(module, key):
    init = lambda key: module.init(key, jnp.zeros(shape, jnp.float32))
    shardings = nn.get_sharding(jax.eval_shape(init, key), mesh)
    return jax.jit(init, out_shardings=shardings)(key)

  teacher_params = init_sharded(teacher, key_teacher)
  params = init_sharded(model, key_init)
  tx = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.1),
                   weight_decay=1e-4)
  opt_shardings = nn.get_sharding(jax.eval_shape(tx.init, params), mesh)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  param_shardings = jax.tree.map(lambda a: a.sharding, params)

  @jax.jit
  def batch(teacher_params, step):
    """Fresh tokens, and the teacher's output for them."""
    x = jax.random.normal(jax.random.fold_in(key_data, step), shape, jnp.float32)
    x = jax.lax.with_sharding_constraint(x, tokens)
    return x, teacher.apply(teacher_params, x)

  def loss_fn(params, x, y):
    return jnp.mean(jnp.square(model.apply(params, x).astype(jnp.float32) - y))

  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step_fn = jax.jit(train_step,
                    in_shardings=(param_shardings, opt_shardings, tokens, tokens),
                    out_shardings=(param_shardings, opt_shardings, replicated),
                    donate_argnums=(0, 1))
  x, y = batch(teacher_params, 0)
  t0 = time.perf_counter()
  # Compiled once, ahead of time: the same program runs and is counted below.
  compiled = step_fn.lower(params, opt_state, x, y).compile()
  say(f"compiled the training step in {time.perf_counter() - t0:.1f} s")

  losses, times = [], []
  bar = tqdm(range(args.steps), disable=not rank0, ncols=90, mininterval=0.5)
  for step in bar:
    x, y = batch(teacher_params, step)
    jax.block_until_ready((x, y))
    t = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, x, y)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - t)
    bar.set_postfix(loss=f"{losses[-1]:.4f}",
                    tok_s=f"{args.tokens / times[-1]:,.0f}", refresh=False)
  bar.close()
  # The first steps include warm-up (allocation, autotuning): leave them out.
  steady = times[min(2, len(times) - 1):]
  tokens_per_s = args.tokens * len(steady) / sum(steady)
  say(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} "
      f"({losses[-1] / losses[0]:.2f}x), {tokens_per_s:,.0f} tokens/s")

  summary = layer_report(compiled, config, mesh, dtype, args, say)
  summary.update(
      losses=losses, first_loss=losses[0], last_loss=losses[-1],
      tokens_per_s=tokens_per_s, jax_version=jax.__version__,
      devices=[str(d) for d in jax.devices()],
      device_kind=jax.devices()[0].device_kind, process_count=jax.process_count(),
      mesh={"dp": mesh.shape["dp"], "tp": tp}, args=vars(args))
  if args.json_out and rank0:
    with open(args.json_out, "w") as f:
      json.dump(summary, f, indent=2)
  return summary


def layer_report(compiled, config, mesh, dtype, args, say) -> dict:
  """Prints and returns the path of every layer and the collectives of one
  training step: counted in the compiled program, and expected."""
  tp = mesh.shape["tp"]
  fc1 = report.layer_path(config, mesh, "tp", dtype,
                          keep_gathered_input=args.keep_gathered_input).path
  fc2 = report.layer_path(config, mesh, "tp", dtype, reduce_scatter_layer=True).path
  say(f"layers (backend {args.backend!r}, tp={tp}, {args.dtype}):")
  for i in range(args.layers):
    say(f"  block{i}: fc1 (column-parallel): {fc1:<22}  fc2 (row-parallel): {fc2}")

  counted = hlo.count_collectives(compiled.as_text())
  per_block = report.expected_all_gathers(config, mesh, "tp", dtype,
                                          keep_gathered_input=args.keep_gathered_input)
  expected = {"standalone_all_gathers": args.layers * per_block.standalone_all_gathers,
              "fused_all_gather_matmuls": args.layers * per_block.fused_all_gather_matmuls}
  got = {"standalone_all_gathers": counted.all_gather,
         "fused_all_gather_matmuls": counted.fused_all_gather_matmul}
  say(f"collectives per training step (forward + backward, {args.layers} blocks):")
  for name, label in (("standalone_all_gathers", "standalone all-gathers"),
                      ("fused_all_gather_matmuls", "fused AllGather+GEMM calls")):
    verdict = "ok" if got[name] == expected[name] else "MISMATCH"
    say(f"  {label:<28} counted {got[name]:>3}   expected {expected[name]:>3}  {verdict}")
  say(f"  {'reduce-scatters (XLA)':<28} counted {counted.reduce_scatter:>3}")
  say(f"  {'fused GEMM+ReduceScatter':<28} counted {counted.fused_matmul_reduce_scatter:>3}")
  return {
      "paths": [{"block": i, "fc1": fc1, "fc2": fc2} for i in range(args.layers)],
      "counts": {**got, "reduce_scatters": counted.reduce_scatter,
                 "fused_matmul_reduce_scatters": counted.fused_matmul_reduce_scatter,
                 "all_reduces": counted.all_reduce},
      "expected": expected,
  }


if __name__ == "__main__":
  main()
