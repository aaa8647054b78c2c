"""The Llama-class block (jax_comm_gemm.layers.llama) against an unsharded
reference written here in plain jax and run in float64: RMSNorm, q/k/v
projections of a grouped-query attention (key/value heads repeated for their
query heads), rotary embeddings (rotate_half), causal softmax attention, the
gated MLP. Forward and the gradients of every parameter and of x, at TP 1, 2,
4 and 8 on simulated CPU devices, with the key/value heads split and
replicated; the gated MLP's all-gathers counted in the compiled program; bad
input named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_mesh
from fused_emulation import SCOPE, EmulatedFusedBackend, relative_error
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import CommGemmConfig, hlo
from jax_comm_gemm.layers import dense, llama
from jax_comm_gemm.layers.gated_mlp import gated_mlp
from test_transformer import x64

SEQ, BATCH, D, HEADS, F = 16, 2, 32, 8, 32  # head_dim 4


# --- the reference: plain jax, unsharded --------------------------------------------------

def _rotate(x, base):
  """x [seq, batch, heads, hd] rotated at positions 0.. (Hugging Face's rotate_half)."""
  hd = x.shape[-1]
  inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
  angle = np.arange(x.shape[0])[:, None] * inv[None, :]
  cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None, None, :]
  sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None, None, :]
  rotated = jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
  return x * cos + rotated * sin


def reference_block(x, p, *, heads, kv_heads, activation=jax.nn.silu, base=10000.0,
                    eps=1e-5):
  seq, batch, d = x.shape
  hd = p["attention"]["q"]["kernel"].shape[1] // heads

  def rms(x, norm):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * norm["scale"]

  def linear(x, layer, part=None):
    w, b = layer["kernel"], layer.get("bias")
    if part is not None:
      w, b = w[:, part], None if b is None else b[part]
    return x @ w + (0 if b is None else b)

  h = rms(x, p["attention_norm"])
  a = p["attention"]
  q = linear(h, a["q"]).reshape(seq, batch, heads, hd)
  k = linear(h, a["kv"], 0).reshape(seq, batch, kv_heads, hd)
  v = linear(h, a["kv"], 1).reshape(seq, batch, kv_heads, hd)
  q, k = _rotate(q, base), _rotate(k, base)
  k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
  logits = jnp.einsum("sbhd,tbhd->bhst", q, k) / np.sqrt(hd)
  logits = jnp.where(np.tril(np.ones((seq, seq), bool)), logits, -1e30)
  out = jnp.einsum("bhst,tbhd->sbhd", jax.nn.softmax(logits, -1), v).reshape(seq, batch, -1)
  x = x + linear(out, a["out"])
  h = rms(x, p["mlp_norm"])
  m = p["mlp"]
  gated = activation(linear(h, m["gate_up"], 0)) * linear(h, m["gate_up"], 1)
  return x + linear(gated, m["down"])


def reference(params, x, ct, **kw):
  """(y, (d params, dx)) of sum(block(x) * ct) in float64."""
  with x64():
    params, x, ct = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)),
                                 (params, x, ct))
    loss = lambda p, x: jnp.sum(reference_block(x, p, **kw) * ct)
    y = reference_block(x, params, **kw)
    grads = jax.grad(loss, argnums=(0, 1))(params, x)
    return jax.tree.map(np.asarray, (y, grads))


# --- setting up ---------------------------------------------------------------------------

def random_params(layout, seed=0):
  rng = np.random.default_rng(seed)

  def make(path, spec):
    name = jax.tree_util.keystr(path)
    if "kernel" in name:
      return rng.normal(size=spec.shape) / np.sqrt(spec.shape[0])
    return (1.0 if "scale" in name else 0.0) + 0.2 * rng.normal(size=spec.shape)

  return jax.tree_util.tree_map_with_path(lambda p, s: make(p, s).astype(np.float32), layout)


def inputs(options, size, use_bias=False, seed=0):
  layout = llama.param_layout(D, F, options, "tp", size, use_bias)
  kx, kc = jax.random.split(jax.random.key(seed))
  return (random_params(layout, seed), jax.random.normal(kx, (SEQ, BATCH, D)),
          jax.random.normal(kc, (SEQ, BATCH, D)))


def run(mesh, options, params, x, ct):
  """(y, (d params, dx)) of sum(block(x) * ct) on `mesh`, params placed as
  their layout says."""
  layout = llama.param_layout(D, F, options, "tp", mesh.shape["tp"],
                              "bias" in params["attention"]["q"])
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                        llama.partition_specs(layout))
  x = jax.device_put(x, NamedSharding(mesh, P("tp")))

  def loss(p, x):
    y = llama.sharded_llama_block(x, p, mesh=mesh, options=options)
    return jnp.sum(y * ct), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


def assert_matches(got, want, tol):
  (y, (dp, dx)), (y_ref, (dp_ref, dx_ref)) = got, want
  assert relative_error(y, y_ref) <= tol, ("y", relative_error(y, y_ref))
  assert relative_error(dx, dx_ref) <= tol, ("dx", relative_error(dx, dx_ref))
  assert jax.tree.structure(dp) == jax.tree.structure(dp_ref)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(dp), jax.tree.leaves(dp_ref)):
    err = relative_error(g, r)
    assert err <= tol, f"d{jax.tree_util.keystr(path)}: relative error {err:.3g}"


# --- the block against float64 --------------------------------------------------------------

# (tp, kv heads, bias, activation): split (kv % tp == 0) and replicated key/value
# heads, multi-query (1) and multi-head (8), SwiGLU and GeGLU, with and without biases.
CASES = {
    "tp1_gqa": (1, 2, False, jax.nn.silu),
    "tp2_gqa_split_bias_geglu": (2, 2, True, jax.nn.gelu),
    "tp4_gqa_replicated": (4, 2, False, jax.nn.silu),
    "tp8_mqa_replicated_bias": (8, 1, True, jax.nn.silu),
    "tp4_mha_split": (4, 8, False, jax.nn.silu),
}


def test_block_in_bfloat16_matches_float64():
  """bfloat16 activations and computation (float32 parameters): within
  bfloat16's rounding, as the GPT block's bfloat16 tests."""
  options = llama.LlamaOptions(HEADS, 2, dtype=jnp.bfloat16)
  params, x, ct = inputs(options, 2)
  got = run(cpu_mesh(2), options, params, x.astype(jnp.bfloat16), ct)
  assert got[0].dtype == jnp.bfloat16
  assert_matches(got, reference(params, x.astype(jnp.bfloat16), ct, heads=HEADS, kv_heads=2),
                 4e-2)


@pytest.mark.parametrize("case", CASES)
def test_block_matches_float64(case):
  tp, kv, bias, activation = CASES[case]
  options = llama.LlamaOptions(HEADS, kv, activation=activation, rope_base=500.0)
  params, x, ct = inputs(options, tp, bias)
  got = run(cpu_mesh(tp), options, params, x, ct)
  assert_matches(got, reference(params, x, ct, heads=HEADS, kv_heads=kv,
                                activation=activation, base=500.0), 2e-5)


def test_head_dim_apart_from_the_width_matches_float64():
  """head_dim given (H * head_dim = 64, twice the width 32), as Gemma's."""
  options = llama.LlamaOptions(HEADS, 4, head_dim=8)
  params, x, ct = inputs(options, 2)
  assert params["attention"]["q"]["kernel"].shape == (D, HEADS * 8)
  assert_matches(run(cpu_mesh(2), options, params, x, ct),
                 reference(params, x, ct, heads=HEADS, kv_heads=4), 2e-5)


def test_local_mode_and_a_data_axis_match_float64():
  """Inside the caller's shard_map over (dp, tp), replicated key/value heads:
  the caller's shard_map sums their gradients."""
  options = llama.LlamaOptions(HEADS, 2)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
  params, x, ct = inputs(options, 4)
  layout = llama.param_layout(D, F, options, "tp", 4)
  f = jax.shard_map(lambda x, p: llama.llama_block(x, p, axis_name="tp", options=options),
                    mesh=mesh, in_specs=(P("tp", "dp"), llama.partition_specs(layout)),
                    out_specs=P("tp", "dp"))
  loss = lambda p, x: (jnp.sum(f(x, p) * ct), f(x, p))
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  assert_matches((y, grads), reference(params, x, ct, heads=HEADS, kv_heads=2), 2e-5)


# --- the gated MLP's all-gathers ----------------------------------------------------------

def _gathers(mlp, keep):
  """(standalone all-gathers, the fused ops' all-gathers) of value_and_grad."""
  config = CommGemmConfig(backend=EmulatedFusedBackend(expose=True))
  mesh = cpu_mesh(2)
  x = jnp.ones((SEQ, D))
  gated = mlp == "gated"
  w1 = jnp.ones((D, 2, F) if gated else (D, F)) * 0.1
  w2 = jnp.ones((F, D)) * 0.1

  def body(x, w1, w2):
    if gated:
      return gated_mlp(x, w1, w2, axis_name="tp", keep_gathered_input=keep, config=config)
    return dense.mlp(x, w1, w2, axis_name="tp", keep_gathered_input=keep, config=config)

  f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, None, "tp") if gated
                                              else P(None, "tp"), P("tp")), out_specs=P("tp"))
  grad = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))
  text = grad.lower(x, w1, w2).compile().as_text()
  total, inside = hlo.count_collectives(text), hlo.count_collectives(text, SCOPE)
  # The forward's gathers as traced (XLA's CSE would merge two gathers of x).
  forward = str(jax.make_jaxpr(f)(x, w1, w2)).count("all_gather[")
  return (total.all_gather - inside.all_gather, inside.all_gather, forward,
          total.reduce_scatter)


@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("keep", [False, True])
def test_gated_mlp_gathers_as_the_gelu_mlp(keep):
  """Gate and up are one AllGather+GEMM: one gather forward (its input once),
  and in the backward the GELU MLP's standalone all-gathers (1, 0 with
  keep_gathered_input) and reduce-scatters (down's forward, gate and up's
  dgrad: 2)."""
  gated, gelu = _gathers("gated", keep), _gathers("gelu", keep)
  assert gated == gelu
  assert gated[0] == (0 if keep else 1)
  assert gated[2] == 1 and gated[3] == 2


# --- bad input ------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=8"):
    llama.LlamaOptions(8, 3)
  with pytest.raises(ValueError, match=r"head_dim must be even, got head_dim=5"):
    llama.LlamaOptions(8, head_dim=5)
  with pytest.raises(ValueError, match=r"rope_base must be a number > 1"):
    llama.LlamaOptions(8, rope_base=0)
  options = llama.LlamaOptions(4)
  params = random_params(llama.param_layout(12, F, options, "tp"))
  with pytest.raises(ValueError, match=r"head_dim must be even, got head_dim=3"):
    llama.sharded_llama_block(jnp.ones((4, 1, 12)), params, mesh=cpu_mesh(1), options=options)
  options = llama.LlamaOptions(HEADS, 2)
  params, x, _ = inputs(options, 1)
  with pytest.raises(ValueError, match=r"`num_heads` has 8 heads, which is not divisible"):
    llama.sharded_llama_block(x[:15], params, mesh=jax.sharding.Mesh(
        np.asarray(jax.devices()[:3]), ("tp",)), options=options)
  with pytest.raises(ValueError, match=r"attention/kv/kernel has shape \(32, 2, 8\), "
                                       r"expected \(32, 2, 16\)"):
    llama.sharded_llama_block(x, params, mesh=cpu_mesh(2),
                              options=llama.LlamaOptions(HEADS, 4))
  with pytest.raises(ValueError, match=r"`gate_up_kernel` must be \[K, 2, F/P\]"):
    jax.shard_map(lambda x, w: gated_mlp(x, w, jnp.ones((F, D)), axis_name="tp"),
                  mesh=cpu_mesh(1), in_specs=(P("tp"), P()), out_specs=P("tp"))(
        jnp.ones((4, D)), jnp.ones((D, F)))


# --- the block's collectives: the GPT block's table -----------------------------------------

@pytest.mark.filterwarnings("ignore:keep_gathered_input=True:RuntimeWarning")
@pytest.mark.parametrize("routing", ["xla_fallback", "fused_with_reuse", "fused_with_reuse_keep"])
def test_block_gathers_as_the_gpt_block(routing):
  """Per block, forward + backward: the GPT block's counts (QKV and gate/up
  are one column-parallel op each, out and down one row-parallel op each):
  fused AllGather+GEMMs, standalone all-gathers and reduce-scatters as
  tests/test_transformer_hlo.py's TABLE says."""
  from test_transformer_hlo import TABLE  # noqa: PLC0415
  config, keep, standalone, fused = TABLE[routing]
  options = llama.LlamaOptions(HEADS, 2, keep_gathered_input=keep, config=config)
  params, x, _ = inputs(options, 2)
  mesh = cpu_mesh(2)
  loss = lambda p, x: jnp.sum(llama.sharded_llama_block(x, p, mesh=mesh, options=options) ** 2)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
  total, inside = hlo.count_collectives(text), hlo.count_collectives(text, SCOPE)
  assert inside.all_gather == fused
  assert total.all_gather - inside.all_gather == standalone
  assert total.reduce_scatter == 4 and inside.reduce_scatter == (4 if fused else 0)
