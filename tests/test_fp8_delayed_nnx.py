"""FP8 "delayed" scaling in the NNX modules, on CPU: each dense layer holds its
amax history in an OverwriteWithGradient variable; empty histories compute what
"tensor" scaling computes (up to the order of the f32 sums); the documented
train step (nnx.Optimizer, ``overwrite_with_gradient``) moves the histories on
as linen's TrainState and the functional block do. (test_fp8_delayed.py: the ops, linen.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import cpu_mesh
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerance import assert_fp8_programs_close

import flax.linen as nn
import jax_comm_gemm as jcg
from jax_comm_gemm import linen as L
from jax_comm_gemm import nnx as X
from jax_comm_gemm.fp8 import AmaxHistory, Fp8Recipe
from jax_comm_gemm.layers import transformer

N, D, F = 64, 48, 32
E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
DELAYED = jcg.CommGemmConfig(fp8=Fp8Recipe("delayed", amax_history=4))
TENSOR = jcg.CommGemmConfig(fp8=Fp8Recipe())
DIFF = nnx.DiffState(0, (nnx.Param, X.OverwriteWithGradient))  # what the docs say
# The reductions along the MLP's gradient, for tests/tolerance.py: fc1's and
# fc2's GEMMs forward (over D, F) and backward (over D, F), and the weight
# gradients' sum over the tokens.
K_MLP = 2 * (D + F) + N
# The same for the transformer block (sequence N, batch 2): two layer norms,
# QKV, out-proj and fc1 (over D), fc2 (over 2D), the attention scores (over
# D / heads) and the softmax and its weighted sum (over the sequence), forward
# and backward, and the weight gradients' sum over sequence x batch.
K_BLOCK = 2 * (8 * D + 2 * N) + 2 * N


def _assert_histories_close(got, want, k, what):
  """Amax histories [x, w, dy] of two programs, row by row (each at its own
  scale): the amaxes of intermediate values (fc2's input, the gradients) are
  maxima of GEMM outputs, as close as those, a flipped E5M2 code upstream
  included (tests/tolerance.py); the inputs' and weights' amaxes are exact,
  and checked exactly where the tests name them."""
  for row, g, w in zip("x w dy".split(), np.asarray(got), np.asarray(want)):
    assert_fp8_programs_close(g, w, fmt=E5, k=k, what=f"{what}: {row}")


def _tokens(mesh, seed, shape=(N, D), boost=True):
  """Tokens sharded over 'tp'; the last shard's rows 100x larger, so its amax is
  every rank's (a rank that scaled with its own amax would differ)."""
  x = jax.random.normal(jax.random.key(seed), shape)
  if boost:
    x = x.at[-shape[0] // mesh.shape["tp"]:].multiply(100.0)
  return jax.device_put(x, NamedSharding(mesh, P("tp")))


def _loss(model, x):
  return jnp.mean(jnp.square(model(x).astype(jnp.float32)))


def test_the_nnx_mlp_trains_its_histories_as_linen_does():
  mesh = cpu_mesh(2)
  assert nnx.variable_type_from_name(OVERWRITE_WITH_GRADIENT) is X.OverwriteWithGradient
  model = X.SequenceParallelMLP(D, F, mesh=mesh, config=DELAYED, rngs=nnx.Rngs(0))
  history = model.fc1.fp8_amax_history
  assert isinstance(history, X.OverwriteWithGradient)
  assert history.get_metadata("out_sharding") == (None, None)
  assert not np.any(np.asarray(history[...])) and history[...].shape == (3, 4)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  x = _tokens(mesh, 1)

  # Local mode, inside the caller's shard_map: the next histories of global mode's step.
  graphdef, values = nnx.split(nnx.clone(model))
  local = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh, out_specs=P("tp"),
                        in_specs=(nnx.get_partition_spec(values), P("tp")))
  local_grads = jax.jit(jax.grad(lambda s, x: _loss(lambda x: local(s, x), x)))(values, x)

  # The documented train step, against linen's TrainState on the same weights.
  optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(_loss, argnums=DIFF)(model, x)
    rest = X.overwrite_with_gradient(model, grads)
    optimizer.update(model, rest)
    return loss, rest

  # Empty histories: what "tensor" scaling computes. Two programs, whose f32
  # sums may round in other orders; the loss is a mean of N * D squares (all
  # its partial sums below the total).
  tensor = X.SequenceParallelMLP(D, F, mesh=mesh, config=TENSOR, rngs=nnx.Rngs(0))
  assert tensor.fc1.fp8_amax_history is None
  want = nnx.jit(nnx.value_and_grad(_loss))(tensor, x)
  got = nnx_step(model, optimizer, x)
  # Two programs of the same FP8 arithmetic: a code may flip (tests/tolerance.py).
  assert_fp8_programs_close(got[0], want[0], fmt=E4, k=K_MLP + N * D, what="loss")
  grads = [jax.tree.leaves_with_path(g) for g in (got[1], want[1])]
  assert [p for p, _ in grads[0]] == [p for p, _ in grads[1]]
  for (path, g), (_, w) in zip(*grads):
    assert_fp8_programs_close(g, w, fmt=E5, k=K_MLP, what=jax.tree_util.keystr(path))
  # Local mode's next histories and global mode's, from two programs.
  for (path, g), (_, w) in zip(*(jax.tree.leaves_with_path(nnx.state(t, X.OverwriteWithGradient))
                                 for t in (local_grads, model))):
    _assert_histories_close(g, w, K_MLP, jax.tree_util.keystr(path))

  zeros = {"fp8_amax_history": AmaxHistory.zeros(DELAYED.fp8)}
  state = TrainState.create(apply_fn=L.SequenceParallelMLP(F, mesh=mesh, config=DELAYED).apply, tx=optax.sgd(1e-3), params={
      "params": params, OVERWRITE_WITH_GRADIENT: {"fc1": zeros, "fc2": zeros}})

  @jax.jit
  def linen_step(state, x):
    loss, grads = jax.value_and_grad(lambda v: _loss(lambda x: state.apply_fn(v, x), x))(
        state.params)
    return state.apply_gradients(grads=grads), loss

  inputs = [x, 2 * x, _tokens(mesh, 2, boost=False)]
  for step, x in enumerate(inputs):
    loss = got[0] if step == 0 else nnx_step(model, optimizer, x)[0]
    state, linen_loss = linen_step(state, x)
    # NNX's program and linen's: the same FP8 arithmetic (tests/tolerance.py).
    assert_fp8_programs_close(loss, linen_loss, fmt=E4, k=K_MLP + N * D, what=f"loss {step}")
  for layer in ("fc1", "fc2"):  # the same histories and weights as linen's
    linen = state.params[OVERWRITE_WITH_GRADIENT][layer]["fp8_amax_history"]
    _assert_histories_close(np.stack(getattr(model, layer).fp8_history()), np.stack(linen),
                            K_MLP, layer)
    # The kernels' updates (SGD: the learning rate times each step's gradient),
    # a flipped E5M2 code in each of the three steps' gradients apart.
    start = params[layer]["kernel"]
    assert_fp8_programs_close(getattr(model, layer).kernel[...] - start,
                              state.params["params"][layer]["kernel"] - start, fmt=E5,
                              k=3 * K_MLP, flips=len(inputs), what=f"{layer} update")
  fc1 = model.fc1.fp8_history()  # newest first: this step's agreed amax in front
  # Exact: maxima of the inputs (2x scales one by a power of two) and of the
  # kernel, shifted; counts are integers.
  amax = [float(jnp.max(jnp.abs(x))) for x in reversed(inputs)]
  assert fc1.x.tolist() == [*amax, 0.0] and amax[1] == 2 * amax[2]
  assert float(fc1.w[2]) == float(jnp.max(jnp.abs(params["fc1"]["kernel"])))
  assert np.count_nonzero(fc1.w) == np.count_nonzero(fc1.dy) == 3


def test_the_nnx_block_holds_a_history_per_dense_layer():
  """The block's four dense layers each hold a history; empty ones compute what
  "tensor" does (up to the order of the f32 sums); one step's next histories
  are the functional block's (init_fp8_histories), and the update writes them
  back."""
  mesh = cpu_mesh(2)
  block = X.SequenceParallelTransformerBlock(D, 4, 2 * D, mesh=mesh, config=DELAYED,
                                             rngs=nnx.Rngs(0))
  tensor = X.SequenceParallelTransformerBlock(D, 4, 2 * D, mesh=mesh, config=TENSOR,
                                              rngs=nnx.Rngs(0))
  histories = nnx.to_pure_dict(nnx.state(block, X.OverwriteWithGradient))
  assert jax.tree.map(np.count_nonzero, histories) == {
      "attention": {"qkv": {"fp8_amax_history": 0}, "out": {"fp8_amax_history": 0}},
      "mlp": {"fc1": {"fp8_amax_history": 0}, "fc2": {"fp8_amax_history": 0}}}
  x = _tokens(mesh, 3, (N, 2, D))
  loss, grads = nnx.jit(nnx.value_and_grad(_loss, argnums=DIFF))(block, x)
  # Two programs; the loss is a mean of squares (its partial sums below the total).
  # (x's residual dominates it: the weights' gradients below are the finer check.)
  loss_t, grads_t = nnx.jit(nnx.value_and_grad(_loss))(tensor, x)
  assert_fp8_programs_close(loss, loss_t, fmt=E4, k=K_BLOCK + x.size, what="loss")

  options = transformer.BlockOptions(4, config=DELAYED)
  functional = jax.jit(jax.grad(lambda params, h: _loss(
      lambda x: transformer.sharded_transformer_block(x, params, mesh=mesh, options=options,
                                                      fp8_histories=h), x), argnums=1))
  want = functional(block.params(), transformer.init_fp8_histories(options))
  rest = X.overwrite_with_gradient(block, grads)
  assert not jax.tree.leaves(nnx.state(rest, X.OverwriteWithGradient))
  pairs = [jax.tree.leaves_with_path(g) for g in (rest, grads_t)]
  assert [p for p, _ in pairs[0]] == [p for p, _ in pairs[1]]
  for (path, g), (_, w) in zip(*pairs):  # the parameters' gradients, of two programs
    assert_fp8_programs_close(g, w, fmt=E5, k=K_BLOCK, what=jax.tree_util.keystr(path))
  written = nnx.to_pure_dict(nnx.state(block, X.OverwriteWithGradient))
  for name in transformer.FP8_LAYERS:
    history = written["attention" if name in ("qkv", "out") else "mlp"][name]
    # The NNX step's next histories and the functional block's: two programs.
    _assert_histories_close(history["fp8_amax_history"], np.stack(want[name]), K_BLOCK, name)
    assert float(want[name].x[0]) > 0 and float(want[name].x[1]) == 0, name


def test_forgetting_the_histories_in_the_gradient_is_named():
  model = X.ColumnParallelDense(D, F, mesh=cpu_mesh(2), config=DELAYED, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"no gradient for fp8_amax_history: differentiate"):
    X.overwrite_with_gradient(model, nnx.state(model, nnx.Param))
  injected = X.ColumnParallelDense(D, F, config=DELAYED, rngs=nnx.Rngs(0),
                                   dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  assert injected.path_reason() and injected.fp8_amax_history is None  # runs no FP8 op


def test_linen_fp8_state_wrapped_by_nnx_bridge_is_the_same_variable_type():
  """A linen module's overwrite-with-gradient collection becomes, through
  nnx.bridge, OverwriteWithGradient variables: one train step serves both."""
  mesh = cpu_mesh(2)
  with jax.set_mesh(mesh):
    wrapped = nnx.bridge.ToNNX(L.ColumnParallelDense(F, mesh=mesh, config=DELAYED),
                               rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(wrapped, jnp.ones((N, D)))
  history = nnx.state(wrapped, X.OverwriteWithGradient)["fp8_amax_history"]
  assert type(history) is X.OverwriteWithGradient
  assert isinstance(history.get_value(), AmaxHistory)
