"""The package files that one forward and backward of the linen
``ColumnParallelDense`` then ``RowParallelDense`` on global arrays run
through, on cuBLASMp's route (a stand-in extension on a CPU: the fused
primitive lowers to XLA's collectives there). Each Python function the trace
and the lowering call is recorded by ``sys.setprofile``."""

import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh

import jax_comm_gemm as jcg
from jax_comm_gemm import collective_matmul
from jax_comm_gemm.layers import dense, transformer
from jax_comm_gemm.flax.linen import ColumnParallelDense, RowParallelDense

ROOT = pathlib.Path(jcg.__file__).resolve().parent.parent


def files_on_the_path() -> tuple[set[str], set[tuple[str, str]]]:
  """(the repository-relative paths of the package's files that run while a
  forward+backward of the two layers is traced and lowered, the (file,
  function) of each read of the plan in force among them). Call with the
  stand-in extension installed (tests/fake_native.py)."""
  mesh = Mesh(np.asarray(jax.devices("cpu")[:2]), ("tp",))
  jcg.connect(mesh, "tp")
  config = jcg.CommGemmConfig(backend="cublasmp", reduce_scatter="split_p2p")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = ColumnParallelDense(24, mesh=mesh, config=config)(x)
      return RowParallelDense(10, mesh=mesh, config=config)(h)

  model = Block()
  # Shapes no other test uses, and the library's jits emptied: every jit of the
  # path traces afresh here, whatever ran before in this process.
  forget_traces()
  x = jnp.ones((14, 10), jnp.float32)
  with jax.set_mesh(mesh):
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
      return jnp.sum(model.apply(params, x) ** 2)

    return traced(lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x))


def forget_traces() -> None:
  """Empties the library's own jits' caches (the layers', the block's and the
  custom_vjps'), so that a trace runs all of the library's code again."""
  for jitted in (dense._column, dense._row, dense._mlp, transformer._sharded,
                 collective_matmul._all_gather_matmul_jit,
                 collective_matmul._matmul_reduce_scatter_jit):
    jitted.clear_cache()


def traced(run) -> tuple[set[str], set[tuple[str, str]]]:
  """(the package files that run during `run()`, the (file, function) of
  each read of the plan in force among them), by ``sys.setprofile``."""
  seen: set[str] = set()
  reads: set[tuple[str, str]] = set()
  package = str(ROOT / "jax_comm_gemm")

  def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(package):
      seen.add(frame.f_code.co_filename)
      if frame.f_code.co_name == "current_plan":
        caller = frame.f_back.f_code
        reads.add((_relative(caller.co_filename), caller.co_name))

  sys.setprofile(profile)
  threading.setprofile(profile)
  try:
    run()
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
  return {_relative(f) for f in seen}, reads


def _relative(path: str) -> str:
  return str(pathlib.Path(path).resolve().relative_to(ROOT))
