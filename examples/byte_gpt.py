"""A byte-level GPT built from jax-comm-gemm's sequence-parallel transformer
blocks (GPT-2's or, with ``arch="llama"``, Llama's), with its training step
and checkpoints.

Layout: tokens ``[seq, batch]`` (Megatron's order), the sequence sharded over
the mesh axis ``tp`` and the batch over ``dp``. The activations between blocks
are ``[seq, batch, d_model]``, sharded the same way; inside a block the
column-parallel layers gather the sequence and split the heads and hidden
features over ``tp`` (see ``jax_comm_gemm.layers.transformer``). The byte
embedding (256 x d_model, tied to the output layer), the learned positions and
the final LayerNorm are small and replicated; XLA partitions them along the
tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_comm_gemm as jcg
from jax_comm_gemm import CommGemmConfig
from jax_comm_gemm.linen import SequenceParallelLlamaBlock, SequenceParallelTransformerBlock

VOCAB = 256  # bytes
TOKENS = P("tp", "dp")  # [seq, batch]
ACTIVATIONS = P("tp", "dp", None)  # [seq, batch, d_model]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  d_model: int
  heads: int
  layers: int
  hidden: int
  seq_len: int
  # "gpt": SequenceParallelTransformerBlocks (LayerNorm, GELU MLP, learned
  # positions); "llama": SequenceParallelLlamaBlocks (RMSNorm, SwiGLU, rotary
  # embeddings, kv_heads key/value heads, no biases).
  arch: str = "gpt"
  kv_heads: int | None = None


class ByteGPT(nn.Module):
  """Bytes ``[seq, batch]`` to next-byte logits ``[seq, batch, 256]`` (float32)."""

  model: ModelConfig
  mesh: Mesh
  dtype: Any = jnp.float32
  keep_gathered_input: bool = False
  remat: bool = False
  config: CommGemmConfig = CommGemmConfig()
  attention: str | None = None  # dot_product_attention's implementation

  @nn.compact
  def __call__(self, tokens):
    m = self.model
    llama = m.arch == "llama"
    embed = nn.Embed(VOCAB, m.d_model, embedding_init=nn.initializers.normal(0.02),
                     name="embed")
    x = embed(tokens)
    if not llama:  # learned positions (the Llama blocks rotate q and k instead)
      positions = self.param("positions", nn.initializers.normal(0.01),
                             (m.seq_len, m.d_model))
      x = x + positions[:tokens.shape[0], None, :]
    x = jax.lax.with_sharding_constraint(x.astype(self.dtype),
                                         NamedSharding(self.mesh, ACTIVATIONS))
    kind = SequenceParallelLlamaBlock if llama else SequenceParallelTransformerBlock
    block = nn.remat(kind) if self.remat else kind
    extra = {"num_kv_heads": m.kv_heads} if llama else {}
    for i in range(m.layers):
      x = block(m.heads, m.hidden, mesh=self.mesh, data_axes=("dp",), dtype=self.dtype,
                keep_gathered_input=self.keep_gathered_input, config=self.config,
                attention_implementation=self.attention, name=f"block{i}", **extra)(x)
    norm = nn.RMSNorm if llama else nn.LayerNorm
    x = norm(dtype=jnp.float32, name="ln_f")(x)
    return embed.attend(x)


def loss_fn(model: ByteGPT, params, tokens, targets):
  logits = model.apply(params, tokens)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def trained(variables):
  """What the optimizer updates: the parameters, without a "delayed" FP8
  recipe's amax histories (Flax's overwrite-with-gradient collection, which
  the step replaces with its gradient, as flax's TrainState does)."""
  return variables["params"] if OVERWRITE_WITH_GRADIENT in variables else variables


# The warm-up starts at lr / WARMUP_FROM and grows geometrically to lr. At the
# first steps a wide model's gradient is coherent and Adam moves every weight
# by the full rate: at the GPU preset's width one step at 5e-6 made the loss
# climb by 2 nats, one at 5e-7 did not
# (benchmarks/results/2026-12-03_cpu_lr/README.md#the-first-steps-at-the-gpu-presets-width).
WARMUP_FROM = 100.0


def optimizer(lr: float, steps: int, warmup: int | None = None) -> optax.GradientTransformation:
  """AdamW: a geometric warm-up from lr / WARMUP_FROM to `lr` over `warmup`
  steps (default a fifth of a short run, at most 100), then a cosine decay to
  lr / 10 at `steps`."""
  if warmup is None:
    warmup = max(1, min(100, steps // 5))
  warm = optax.exponential_decay(lr / WARMUP_FROM, transition_steps=warmup,
                                 decay_rate=WARMUP_FROM, end_value=lr)
  decay = optax.cosine_decay_schedule(lr, max(1, steps - warmup), alpha=0.1)
  schedule = optax.join_schedules([warm, decay], [warmup])
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.1))


@dataclasses.dataclass
class Trainer:
  """The model's sharded state and its compiled programs."""

  model: ByteGPT
  tx: optax.GradientTransformation
  mesh: Mesh
  param_shardings: Any
  opt_shardings: Any

  @classmethod
  def create(cls, model: ByteGPT, tx, mesh: Mesh, seed: int):
    """Returns (trainer, params, opt_state): parameters created sharded as
    their partitioning metadata says (every array made inside jit, so that this
    also holds with several processes)."""
    tokens = jnp.zeros((model.model.seq_len, mesh.shape["dp"]), jnp.int32)
    init = lambda key: model.init(key, tokens)
    abstract = jax.eval_shape(init, jax.random.key(seed))
    param_shardings = nn.get_sharding(abstract, mesh)
    params = jax.jit(init, out_shardings=param_shardings)(jax.random.key(seed))
    opt_init = lambda params: tx.init(trained(params))
    opt_shardings = nn.get_sharding(jax.eval_shape(opt_init, params), mesh)
    opt_state = jax.jit(opt_init, out_shardings=opt_shardings)(params)
    return cls(model, tx, mesh, param_shardings, opt_shardings), params, opt_state

  def with_config(self, model: ByteGPT) -> "Trainer":
    return dataclasses.replace(self, model=model)

  def step_function(self):
    """The training step, (params, opt_state, tokens, targets) -> (params,
    opt_state, loss), not yet jitted. Its outputs are pinned to the shardings
    of its inputs, so that it keeps them however it is jitted (here with
    shardings and donation; by ``jcg.autotune_step`` with neither)."""

    def step(params, opt_state, tokens, targets):
      loss, grads = jax.value_and_grad(loss_fn, argnums=1)(self.model, params, tokens,
                                                          targets)
      updates, opt_state = self.tx.update(trained(grads), opt_state, trained(params))
      new = optax.apply_updates(trained(params), updates)
      if OVERWRITE_WITH_GRADIENT in params:  # FP8 amax histories: the gradient is the next
        new = {"params": new, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
      pin = jax.lax.with_sharding_constraint
      return (pin(new, self.param_shardings), pin(opt_state, self.opt_shardings), loss)

    return step

  def train_step(self, params, opt_state, tokens, targets):
    """The step compiled ahead of time for these arguments, donating the
    parameters and optimizer state: (params, opt_state, loss)."""
    tokens_sharding = NamedSharding(self.mesh, TOKENS)
    return jax.jit(self.step_function(),
                   in_shardings=(self.param_shardings, self.opt_shardings,
                                 tokens_sharding, tokens_sharding),
                   out_shardings=(self.param_shardings, self.opt_shardings,
                                  NamedSharding(self.mesh, P())),
                   donate_argnums=(0, 1)).lower(params, opt_state, tokens, targets).compile()

  def eval_step(self):
    return jax.jit(lambda params, tokens, targets: loss_fn(self.model, params, tokens,
                                                           targets))

  def next_byte_logits(self):
    """(params, tokens [seq, dp], position) -> the float32 logits [256] of the
    byte after `position` in the first column: what `sample` draws from."""
    return jax.jit(lambda params, tokens, position: self.model.apply(params, tokens)[
        position, 0].astype(jnp.float32))


def sample(next_logits, params, mesh: Mesh, prompt: bytes, length: int, seq_len: int,
           seed: int = 0, temperature: float = 0.8) -> bytes:
  """`length` bytes after `prompt`, each drawn from the model's distribution at
  `temperature` (numpy's generator of `seed`: the same draws in every process).
  The window holds the last `seq_len` bytes; causal attention lets the bytes
  after the current position be anything (zeros). Collective with several
  processes: every process calls it."""
  if not 0 < len(prompt) < seq_len:
    raise ValueError(f"the prompt must hold 1 to {seq_len - 1} bytes, not {len(prompt)}")
  rng = np.random.default_rng(seed)
  text = list(prompt)
  sharding = NamedSharding(mesh, TOKENS)
  for _ in range(length):
    recent = text[-(seq_len - 1):]
    window = np.zeros((seq_len, mesh.shape["dp"]), np.int32)
    window[:len(recent)] = np.asarray(recent, np.int32)[:, None]
    tokens = jax.make_array_from_callback(window.shape, sharding, lambda index: window[index])
    logits = np.asarray(next_logits(params, tokens, len(recent) - 1), np.float64) / temperature
    p = np.exp(logits - logits.max())
    text.append(int(rng.choice(256, p=p / p.sum())))
  return bytes(text[len(prompt):])


def autotune(trainer: Trainer, params, opt_state, tokens, targets, say):
  """backend="auto" before training (``jcg.autotune_step``, collective): it
  measures each op of the training step (cached on disk), then the whole step
  under each plan (those choices, or every op on one implementation, XLA among
  them), and returns the fastest as a jitted step that carries its routes."""
  start = time.perf_counter()
  tuned = jcg.autotune_step(trainer.mesh, "tp", trainer.step_function(), params, opt_state,
                            tokens, targets)
  say(f"autotune in {time.perf_counter() - start:.1f} s: plan {tuned.plan!r}: {tuned.why}")
  return tuned


def to_device(mesh: Mesh, batch):
  """A ``[batch, seq + 1]`` uint8 host batch (the same in every process) as
  (tokens, targets) ``[seq, batch]`` int32, sharded ``P('tp', 'dp')``."""
  windows = np.ascontiguousarray(batch.T, np.int32)
  sharding = NamedSharding(mesh, TOKENS)
  make = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
  return make(windows[:-1]), make(windows[1:])


# --- checkpoints ------------------------------------------------------------------------

def checkpoint_manager(directory) -> ocp.CheckpointManager:
  # Synchronous saves: the training step donates the parameters' buffers, and
  # a save must have read them before the next step reuses them.
  options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
  return ocp.CheckpointManager(directory, options=options)


def save(manager: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
      meta=ocp.args.JsonSave(meta)), force=True)


def restore_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def restore(manager: ocp.CheckpointManager, step: int, params, opt_state):
  """(params, opt_state) of `step`, placed like the given arrays."""
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        {"params": params, "opt_state": opt_state})
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target))).state
  return state["params"], state["opt_state"]
