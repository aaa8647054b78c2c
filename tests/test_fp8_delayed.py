"""Delayed scaling (``Fp8Recipe("delayed")``), on CPU: the scale comes from the
amax history, the next history (the op's gradient with respect to it) holds
this step's amax agreed over every replica, an empty history scales as
current scaling does, and the arguments are checked."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import cpu_mesh
from tolerance import assert_differs, assert_fp8_programs_close, assert_reduction_close
from jax_comm_gemm.fp8 import (Fp8Recipe, fp8_all_gather_matmul, fp8_gemm_tn,
                               fp8_matmul_reduce_scatter, inverse, saturating_cast,
                               scale_from_amax)
from jax_comm_gemm.fp8.recipe import AmaxHistory

N, D, F = 64, 48, 32
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
DELAYED = Fp8Recipe("delayed", amax_history=4)
# The reductions along the FP8 MLP's gradient, for tests/tolerance.py: fc1's
# and fc2's GEMMs forward (over D, F) and backward (over D, F), and the
# weight gradients' sum over the tokens.
K_MLP = 2 * (D + F) + N
# The same for the transformer block: two layer norms, QKV, out-proj and fc1
# (over D), fc2 (over 2D), the attention scores (over D / heads) and the
# softmax and its weighted sum (over the sequence), forward and backward, and
# the weight gradients' sum over the tokens (sequence x batch).
K_BLOCK = 2 * (8 * D + 2 * N) + 2 * N


def _inputs(seed=0, boost_shard=None, size=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (N, D))
  if boost_shard is not None:  # one rank's rows 100x larger: its amax is everyone's
    rows = N // size
    x = x.at[boost_shard * rows:(boost_shard + 1) * rows].multiply(100.0)
  return (x, jax.random.normal(keys[1], (D, F)) / np.sqrt(D),
          jax.random.normal(keys[2], (F, D)) / np.sqrt(F))


def _weighted_sum(y):
  """The tests' loss, sum(y * cos(feature)), and the sum of its terms'
  magnitudes (which bounds every partial sum of the loss) as aux."""
  terms = y * jnp.cos(jnp.arange(D, dtype=jnp.float32))
  return jnp.sum(terms), jnp.sum(jnp.abs(terms))


def _step(mesh, recipe, with_history=True):
  """((loss, its terms' magnitude), gradients (those of the histories too))
  of an FP8 MLP."""
  def mlp(x, w1, w2, h1, h2):
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe, history=h1)
    return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe, history=h2)
  specs = (P("tp"), P(None, "tp"), P("tp"), P(), P())
  if not with_history:
    return _step_without(mesh, recipe)
  f = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp"))
  return jax.jit(jax.value_and_grad(lambda *a: _weighted_sum(f(*a)), argnums=(0, 1, 2, 3, 4),
                                    has_aux=True))


def _step_without(mesh, recipe):
  def mlp(x, w1, w2):
    h = fp8_all_gather_matmul(x, w1, "tp", recipe=recipe)
    return fp8_matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", recipe=recipe)
  f = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                    out_specs=P("tp"))
  return jax.jit(jax.value_and_grad(lambda *a: _weighted_sum(f(*a)), argnums=(0, 1, 2),
                                    has_aux=True))


def _gathered(mesh, recipe, x, w, history=None):
  """The forward's gathered x as the FP8 GEMM saw it (its bytes at its scale),
  every rank's copy side by side."""
  kw = {} if history is None else {"history": history}
  f = lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=recipe, return_gathered=True,
                                         **kw)[1][None]
  return np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                          out_specs=P("tp")))(x, w))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_an_empty_history_scales_as_current_scaling(size):
  """The first step (all-zero histories) is the "tensor" recipe's: the same
  FP8 operand, bit for bit, and the same loss and gradients up to rounding."""
  mesh = cpu_mesh(size)
  args = _inputs(seed=size)
  h0 = AmaxHistory.zeros(DELAYED)
  # Exact by construction: the same amax (a maximum), the same scale (one
  # division), the same bytes (one multiply and one rounding each) and the same
  # dequantization (one multiply).
  np.testing.assert_array_equal(_gathered(mesh, DELAYED, *args[:2], history=h0),
                                _gathered(mesh, Fp8Recipe("tensor"), *args[:2]))
  ((loss, _), grads) = _step(mesh, DELAYED)(*args, h0, h0)
  ((loss_t, size_t), grads_t) = _step_without(mesh, Fp8Recipe("tensor"))(*args)
  # Two programs: their GEMMs' f32 sums may round in other orders, and so may
  # GELU's input and output: an E4M3 code of fc2's input may flip (the loss),
  # an E5M2 code of fc1's output gradient (tests/tolerance.py).
  assert_fp8_programs_close(loss, loss_t, fmt=E4, k=K_MLP + N * D, scale=size_t, what="loss")
  for name, got, want in zip(("dx", "dw1", "dw2"), grads[:3], grads_t):
    assert_fp8_programs_close(got, want, fmt=E5, k=K_MLP, what=name)


@pytest.mark.parametrize("size", [1, 2])
def test_the_scale_comes_from_the_history(size):
  """With amaxes in the histories (the largest counts), the forward quantizes
  x and w with the histories' scales: the FP8 GEMM of the operands cast with
  those scales (up to the order of its f32 sums), and unlike current
  scaling's."""
  mesh = cpu_mesh(size)
  x, w1, _ = _inputs(seed=3)
  hx = jnp.array([2.0, 7.0, 0.0, 1.0])   # x's amax is about 4: a foreign scale
  hw = jnp.array([0.5, 0.0, 3.0, 0.0])
  history = AmaxHistory(hx, hw, jnp.zeros(4))
  f = jax.jit(jax.shard_map(
      lambda x, w, h: fp8_all_gather_matmul(x, w, "tp", recipe=DELAYED, history=h),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp")))
  got = f(x, w1, history)
  sx, sw = scale_from_amax(7.0, E4), scale_from_amax(3.0, E4)
  want = fp8_gemm_tn(saturating_cast(x, sx, E4), saturating_cast(w1.T, sw, E4),
                     inverse(sx), inverse(sw), jnp.float32)
  # Two programs (the sharded op and the reference): a GEMM of D-long f32 sums.
  assert_reduction_close(got, want, k=D)
  current = jax.jit(jax.shard_map(
      lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=Fp8Recipe()),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))(x, w1)
  assert_differs(current, got, k=D, what="current scaling")


def test_values_beyond_the_history_saturate():
  """A history far below this step's amax: x's values beyond it clip to the
  E4M3 maximum (finite, not NaN), and the next history holds the true amax."""
  x, w1, _ = _inputs(seed=4)
  history = AmaxHistory(jnp.array([0.01, 0.0, 0.0, 0.0]), jnp.zeros(4), jnp.zeros(4))
  mesh = cpu_mesh(1)
  f = jax.shard_map(
      lambda x, w, h: fp8_all_gather_matmul(x, w, "tp", recipe=DELAYED, history=h),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp"))
  y = jax.jit(f)(x, w1, history)
  assert np.all(np.isfinite(np.asarray(y)))
  sx, sw = scale_from_amax(0.01, E4), scale_from_amax(jnp.max(jnp.abs(w1)), E4)
  clipped = jnp.clip(x, -0.01, 0.01)  # what the saturating cast keeps of x
  want = fp8_gemm_tn(saturating_cast(clipped, sx, E4), saturating_cast(w1.T, sw, E4),
                     inverse(sx), inverse(sw), jnp.float32)
  assert_reduction_close(y, want, k=D)  # two programs: a GEMM of D-long f32 sums
  grads = jax.jit(jax.grad(lambda x, w, h: jnp.sum(f(x, w, h)), argnums=2))(x, w1, history)
  assert float(grads.x[0]) == float(jnp.max(jnp.abs(x)))  # a maximum: exact


@pytest.mark.parametrize("size", [2, 4])
def test_the_next_history_holds_the_agreed_amax(size):
  """The histories' gradients are the next histories: this step's amax in
  front, the oldest dropped; the amax is the whole tensor's (one rank's rows
  100x larger sets it for all), on every rank alike."""
  mesh = cpu_mesh(size)
  x, w1, w2 = _inputs(seed=5, boost_shard=size - 1, size=size)
  h1 = AmaxHistory(jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([5.0, 0.0, 0.0, 0.0]),
                   jnp.array([6.0, 7.0, 0.0, 0.0]))
  h2 = AmaxHistory.zeros(DELAYED)
  _, grads = _step(mesh, DELAYED)(x, w1, w2, h1, h2)
  n1, n2 = grads[3], grads[4]
  # Exact: the amaxes of the inputs are maxima (no rounding), the rest a shift.
  np.testing.assert_allclose(n1.x, [float(jnp.max(jnp.abs(x))), 1.0, 2.0, 3.0], rtol=0)
  np.testing.assert_allclose(n1.w, [float(jnp.max(jnp.abs(w1))), 5.0, 0.0, 0.0], rtol=0)
  assert float(n1.dy[0]) > 0 and n1.dy[1:].tolist() == [6.0, 7.0, 0.0]
  assert float(n2.w[0]) == float(jnp.max(jnp.abs(w2))) and float(n2.x[0]) > 0


def test_the_history_is_one_for_all_data_replicas():
  """On a ('dp', 'tp') mesh each replica sees other tokens; the next history
  is their agreed amax, not a sum over the replicas."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
  x, w1, _ = _inputs(seed=6)
  x = x.at[:N // 2].multiply(10.0)  # the first replica's tokens are larger
  f = jax.shard_map(
      lambda x, w, h: fp8_all_gather_matmul(x, w, "tp", recipe=DELAYED, history=h),
      mesh=mesh, in_specs=(P(("dp", "tp")), P(None, "tp"), P()),
      out_specs=P("dp", "tp"))
  h = AmaxHistory.zeros(DELAYED)
  nxt = jax.jit(jax.grad(lambda x, w, h: jnp.sum(f(x, w, h)), argnums=2))(x, w1, h)
  # Exact: a maximum of the inputs, agreed by a maximum over the replicas.
  assert float(nxt.x[0]) == float(jnp.max(jnp.abs(x)))
  assert float(nxt.w[0]) == float(jnp.max(jnp.abs(w1)))


@pytest.mark.parametrize("recipe, history, match", [
    (DELAYED, None, r"a 'delayed' recipe needs `history`, an AmaxHistory"),
    (Fp8Recipe(), AmaxHistory.zeros(DELAYED), r"`history` is for a 'delayed' recipe"),
    (DELAYED, AmaxHistory(jnp.zeros(3), jnp.zeros(4), jnp.zeros(4)),
     r"`history.x` must have shape \(4,\)"),
])
def test_a_bad_history_names_the_argument(recipe, history, match):
  mesh = cpu_mesh(1)
  x, w1, _ = _inputs()
  with pytest.raises(ValueError, match=match):
    jax.shard_map(lambda x, w: fp8_all_gather_matmul(x, w, "tp", recipe=recipe,
                                                     history=history),
                  mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(x, w1)
  with pytest.raises(ValueError, match="amax_history must be an int >= 1"):
    Fp8Recipe("delayed", amax_history=0)


# --- through the front door -----------------------------------------------------------

def test_the_linen_layers_keep_their_histories_in_the_overwrite_collection():
  """linen dense layers with a "delayed" config keep an AmaxHistory each in
  Flax's overwrite-with-gradient collection; Flax's TrainState replaces it with
  its gradient, the next history, while the optimizer updates the params."""
  import optax
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training.train_state import TrainState

  import flax.linen as nn
  import jax_comm_gemm as jcg
  from jax_comm_gemm import linen as L

  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(fp8=DELAYED)

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = L.ColumnParallelDense(F, mesh=mesh, config=config, name="fc1")(x)
      return L.RowParallelDense(D, mesh=mesh, config=config, name="fc2")(jax.nn.gelu(h))

  x, _, _ = _inputs(seed=7)
  model = Mlp()
  variables = model.init(jax.random.key(0), x)
  histories = variables[OVERWRITE_WITH_GRADIENT]
  assert set(histories) == {"fc1", "fc2"}
  assert all(float(jnp.sum(h)) == 0 for h in jax.tree.leaves(histories))
  state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(1e-3))

  @jax.jit
  def train_step(state, x):
    grads = jax.grad(lambda v: jnp.sum(state.apply_fn(v, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  state = train_step(state, x)
  fc1 = state.params[OVERWRITE_WITH_GRADIENT]["fc1"]["fp8_amax_history"]
  # Exact: maxima of the input and of the kernel (2x scales them by a power of two).
  assert float(fc1.x[0]) == float(jnp.max(jnp.abs(x)))
  kernel = variables["params"]["fc1"]["kernel"]
  kernel = getattr(kernel, "value", kernel)
  assert float(fc1.w[0]) == float(jnp.max(jnp.abs(kernel)))
  state = train_step(state, 2 * x)  # the history moves on, newest first
  fc1 = state.params[OVERWRITE_WITH_GRADIENT]["fc1"]["fp8_amax_history"]
  assert float(fc1.x[0]) == 2 * float(jnp.max(jnp.abs(x)))
  assert float(fc1.x[1]) == float(jnp.max(jnp.abs(x)))
  assert float(fc1.dy[0]) > 0 and float(fc1.dy[1]) > 0


def test_the_functional_layers_take_a_history():
  """column_parallel_dense on global arrays with fp8_history: the same result
  as the op with that history, and its gradient is the next history."""
  import jax_comm_gemm as jcg
  from jax_comm_gemm import sharded

  mesh = cpu_mesh(2)
  config = jcg.CommGemmConfig(fp8=DELAYED)
  x, w1, _ = _inputs(seed=8)
  h = AmaxHistory(jnp.array([9.0, 0, 0, 0]), jnp.array([2.0, 0, 0, 0]), jnp.zeros(4))
  f = jax.jit(lambda x, w, h: sharded.column_parallel_dense(x, w, mesh=mesh, config=config,
                                                             fp8_history=h))
  op = jax.jit(jax.shard_map(
      lambda x, w, h: fp8_all_gather_matmul(x, w, "tp", recipe=DELAYED, history=h),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp")))
  # Two programs (the layer's and the op's): a GEMM of D-long f32 sums.
  assert_reduction_close(f(x, w1, h), op(x, w1, h), k=D)
  nxt = jax.grad(lambda h: jnp.sum(f(x, w1, h)))(h)
  # Exact: a shift of the history and a maximum of the input.
  assert nxt.x.tolist()[1:] == [9.0, 0.0, 0.0] and float(nxt.x[0]) == float(
      jnp.max(jnp.abs(x)))


def test_front_ends_without_histories_say_so():
  """A block or an MLP helper called without its histories: a "delayed" config
  is a ValueError naming the front end; a history for a config that is not
  "delayed" is one too. (NNX: test_fp8_delayed_nnx.py.)"""
  import jax_comm_gemm as jcg
  from jax_comm_gemm import sharded
  from jax_comm_gemm.layers import transformer

  config = jcg.CommGemmConfig(fp8=DELAYED)
  mesh = cpu_mesh(2)
  x, w1, w2 = _inputs()
  params = jax.tree.map(lambda spec: jnp.ones(spec.shape),
                        transformer.param_layout(D, 2 * D, "tp"))
  with pytest.raises(ValueError, match=r"FP8 'delayed' scaling needs `fp8_histories`"):
    transformer.sharded_transformer_block(x.reshape(N, 1, D), params, mesh=mesh,
                                          options=transformer.BlockOptions(2, config=config))
  with pytest.raises(ValueError, match=r"sharded.mlp: FP8 'delayed' scaling needs "
                                       r"`fp8_histories`.*init_mlp_fp8_histories"):
    sharded.mlp(x, w1, w2, mesh=mesh, config=config)
  with pytest.raises(ValueError, match=r"sharded.mlp: `fp8_histories` is for CommGemmConfig"):
    sharded.mlp(x, w1, w2, mesh=mesh, fp8_histories=sharded.init_mlp_fp8_histories(config))
  with pytest.raises(ValueError, match=r"`fp8_history` is for CommGemmConfig"):
    jax.eval_shape(lambda x, w: sharded.column_parallel_dense(
        x, w, mesh=mesh, config=jcg.CommGemmConfig(fp8=Fp8Recipe()),
        fp8_history=AmaxHistory.zeros(DELAYED)), x, w1)


def test_the_transformer_block_carries_a_history_per_dense_layer():
  """The functional block with init_fp8_histories: empty histories compute what
  "tensor" scaling computes (up to the order of the f32 sums), and the next
  ones hold each dense layer's amaxes (the weight's exactly)."""
  import jax_comm_gemm as jcg
  from jax_comm_gemm.layers import transformer

  mesh = cpu_mesh(2)
  keys = jax.random.split(jax.random.key(9), 12)
  layout = transformer.param_layout(D, 2 * D, "tp")
  leaves, tree = jax.tree.flatten(layout, is_leaf=lambda v: isinstance(v, transformer.ParamSpec))
  params = jax.tree.unflatten(tree, [jax.random.normal(k, spec.shape) / np.sqrt(spec.shape[0])
                                     for k, spec in zip(keys, leaves)])
  x = jax.random.normal(keys[-1], (N, 2, D))
  delayed = transformer.BlockOptions(4, config=jcg.CommGemmConfig(fp8=DELAYED))
  tensor = transformer.BlockOptions(4, config=jcg.CommGemmConfig(fp8=Fp8Recipe()))
  histories = transformer.init_fp8_histories(delayed)
  assert set(histories) == set(transformer.FP8_LAYERS)

  def loss(params, histories, options):
    y = transformer.sharded_transformer_block(x, params, mesh=mesh, options=options,
                                              fp8_histories=histories)
    return _weighted_sum(y)

  step = jax.value_and_grad(partial(loss, options=delayed), argnums=(0, 1), has_aux=True)
  (got, _), (_, nxt) = jax.jit(step)(params, histories)
  want, size = jax.jit(partial(loss, histories=None, options=tensor))(params)
  # Two programs: the block's f32 sums and the loss's may round in other
  # orders, and an E4M3 code of what they cast may flip (tests/tolerance.py).
  assert_fp8_programs_close(got, want, fmt=E4, k=K_BLOCK + x.size, scale=size, what="loss")
  kernels = {"qkv": params["attention"]["qkv"], "out": params["attention"]["out"],
             "fc1": params["mlp"]["fc1"], "fc2": params["mlp"]["fc2"]}
  for name, layer in kernels.items():  # a maximum of the kernel: exact
    assert float(nxt[name].w[0]) == float(jnp.max(jnp.abs(layer["kernel"]))), name
    assert float(nxt[name].x[0]) > 0 and float(nxt[name].dy[0]) > 0, name


def test_the_linen_block_keeps_its_histories_in_the_overwrite_collection():
  import optax
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training.train_state import TrainState

  import jax_comm_gemm as jcg
  from jax_comm_gemm import linen as L

  mesh = cpu_mesh(2)
  block = L.SequenceParallelTransformerBlock(4, 2 * D, mesh=mesh,
                                             config=jcg.CommGemmConfig(fp8=DELAYED))
  x = jax.random.normal(jax.random.key(10), (N, 2, D))
  variables = block.init(jax.random.key(0), x)
  state = TrainState.create(apply_fn=block.apply, params=variables, tx=optax.sgd(1e-3))

  @jax.jit
  def train_step(state, x):
    grads = jax.grad(lambda v: jnp.sum(state.apply_fn(v, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  first = train_step(state, x).params[OVERWRITE_WITH_GRADIENT]["fp8_amax_history"]
  second = train_step(train_step(state, x), x).params[OVERWRITE_WITH_GRADIENT][
      "fp8_amax_history"]
  for name in ("qkv", "out", "fc1", "fc2"):
    assert float(first[name].x[0]) > 0 and float(first[name].x[1]) == 0, name
    # Exact: the same compiled step on the same state, then a shift.
    assert float(second[name].x[1]) == float(first[name].x[0]), name
