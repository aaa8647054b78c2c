"""A Llama-class block written in plain jax, for benchmarks/fp8_step.py's
``--arch llama`` reference: RMSNorm, q/k/v from one GEMM, rotary embeddings
(rotate_half), grouped-query attention, SwiGLU from one GEMM, no biases; the
parameters as ``jax_comm_gemm.layers.llama.param_layout`` lays them out (at tp
1), every GEMM through the caller's `dense` (plain FP8 there). No project code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32, BF16 = jnp.float32, jnp.bfloat16


def rms_norm(t, scale, epsilon=1e-5):
  t32 = t.astype(F32)
  return (t32 * lax.rsqrt(jnp.mean(t32 * t32, -1, keepdims=True) + epsilon)
          * scale).astype(BF16)


def rotary(t, base=10000.0):
  """t [batch, seq, heads, head_dim] rotated at positions 0.. (rotate_half)."""
  half = t.shape[-1] // 2
  inverse = base ** (-jnp.arange(half, dtype=F32) * 2 / t.shape[-1])
  angles = jnp.arange(t.shape[1], dtype=F32)[:, None] * inverse[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  t1, t2 = t[..., :half].astype(F32), t[..., half:].astype(F32)
  return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).astype(t.dtype)


def plain_llama_block(p, x, heads: int, attention, dense):
  """One Llama block, x [seq, batch, d]; ``dense(t [n, k], kernel [k, m])``."""
  s, b, d = x.shape
  a = p["attention"]
  q_width = a["q"]["kernel"].shape[1]
  head_dim = q_width // heads
  kv_width = a["kv"]["kernel"].shape[2]
  qkv = dense(rms_norm(x, p["attention_norm"]["scale"]).reshape(s * b, d),
              jnp.concatenate([a["q"]["kernel"], a["kv"]["kernel"].reshape(d, -1)], 1))
  q, k, v = (jnp.swapaxes(t.reshape(s, b, -1, head_dim), 0, 1)
             for t in jnp.split(qkv, [q_width, q_width + kv_width], axis=-1))
  out = jax.nn.dot_product_attention(rotary(q), rotary(k), v, is_causal=True,
                                     implementation=attention)
  x = x + dense(jnp.swapaxes(out, 0, 1).reshape(s * b, -1),
                a["out"]["kernel"]).reshape(x.shape)
  m = p["mlp"]
  gate, up = jnp.split(dense(rms_norm(x, p["mlp_norm"]["scale"]).reshape(s * b, d),
                             m["gate_up"]["kernel"].reshape(d, -1)), 2, axis=-1)
  return x + dense(jax.nn.silu(gate) * up, m["down"]["kernel"]).reshape(x.shape)
