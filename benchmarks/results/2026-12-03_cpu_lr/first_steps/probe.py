"""Which parameters' first real Adam step (lr 5e-6, step 2 of the GPU preset's
warm-up) makes the loss of the next batch climb? Same data and init as
`train_byte_gpt.py --size gpu --seq-len 512 --batch 1 --seed 0`."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4, "examples"))
import jax, jax.numpy as jnp, numpy as np
import train_byte_gpt as t, byte_gpt
from stdlib_bytes import ByteCorpus, stdlib_dir

LAYERS = int(os.environ.get("LAYERS", 4)); SEQ = int(os.environ.get("SEQ", 512))
LR = float(os.environ.get("LR", 5e-6))
mesh = t.make_mesh(None, "cpu")
cfg = byte_gpt.ModelConfig(4096, 32, LAYERS, 16384, SEQ)
model = byte_gpt.ByteGPT(cfg, mesh, jnp.bfloat16, False, False, t.jcg.CommGemmConfig(), "xla")
corpus = ByteCorpus(str(stdlib_dir()))
batch = lambda step: byte_gpt.to_device(mesh, corpus.batch("train", step, batch=1, length=SEQ + 1, seed=0))
tx = byte_gpt.optimizer(6e-5, 60)
trainer, params, _ = byte_gpt.Trainer.create(model, tx, mesh, 0)
loss = jax.jit(lambda p, a, b: byte_gpt.loss_fn(model, p, a, b))
grad = jax.jit(jax.grad(lambda p, a, b: byte_gpt.loss_fn(model, p, a, b)))
g1 = grad(params, *batch(0)); g2 = grad(params, *batch(1))  # update 1 has lr 0: params unchanged
b1, b2 = 0.9, 0.95
def direction(a, b):
  m = (b1 * (1 - b1) * a + (1 - b1) * b) / (1 - b1 ** 2)
  v = (b2 * (1 - b2) * a * a + (1 - b2) * b * b) / (1 - b2 ** 2)
  return m / (jnp.sqrt(v) + 1e-8)
d = jax.jit(lambda a, b: jax.tree.map(direction, a, b))(g1, g2)
del g1, g2
flat = jax.tree_util.tree_flatten_with_path(params)[0]
names = [jax.tree_util.keystr(k) for k, _ in flat]
groups = {"all": lambda n: True, "none": lambda n: False,
          "embed": lambda n: "embed" in n, "positions": lambda n: "positions" in n,
          "ln": lambda n: "'ln" in n, "attn": lambda n: "attn" in n or "qkv" in n or "'out" in n,
          "mlp": lambda n: "mlp" in n or "fc" in n, "biases": lambda n: "bias" in n}
print("params:", len(names), names[:3], names[-3:], flush=True)
x3 = batch(2)
@jax.jit
def moved_loss(p, d, mask, a, b):
  q = jax.tree.map(lambda x, y, m: x - m * LR * y, p, d, mask)
  return byte_gpt.loss_fn(model, q, a, b)
for name, keep in groups.items():
  mask = jax.tree_util.tree_unflatten(jax.tree.structure(params),
                                      [jnp.float32(keep(n)) for n in names])
  print(f"{name:10s} loss(batch 3) {float(moved_loss(params, d, mask, *x3)):.4f}", flush=True)
