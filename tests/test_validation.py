"""Bad arguments fail at trace time, with a message that names the argument
and says what is allowed.

Most cases trace with ``jax.eval_shape`` on ``jax.ShapeDtypeStruct`` inputs:
nothing is compiled or run, so an error there is raised before any device
work. The kernel-placement check needs a concrete array; it raises before
``shard_map`` is entered.

Longer than 300 lines because it lists every argument check, one short test each.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh, stand_in_plan
import flax
import jax_comm_gemm as jcg
import jax_comm_gemm.linen  # noqa: F401  (the modules, as jcg.linen and jcg.nnx)
import jax_comm_gemm.nnx  # noqa: F401
from jax_comm_gemm.runtime.registry import REGISTRY
from jax_comm_gemm.runtime.constants import TARGETS
from jax_comm_gemm.runtime.settings import Settings
from jax_comm_gemm import (CommGemmConfig, all_gather_matmul, dense, matmul_reduce_scatter,
                           sharded, validation)
from jax_comm_gemm.backends import XlaBackend, resolve_backend
from jax_comm_gemm.config import check_config
from jax_comm_gemm.fp8 import Fp8Recipe
from jax_comm_gemm.layers import transformer

F32 = jnp.float32


def _spec(shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _trace_in_shard_map(local, in_specs, *shapes, size=4, dtype=F32):
  """Traces `local` inside shard_map over a ('tp',) mesh of `size` devices,
  on abstract inputs of the given global `shapes` (shape or (shape, dtype))."""
  mesh = cpu_mesh(size)
  args = [_spec(*s) if isinstance(s[0], tuple) else _spec(s, dtype) for s in shapes]
  fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(),
                     check_vma=False)
  return jax.eval_shape(fn, *args)


def _mesh_2d() -> Mesh:
  return Mesh(np.asarray(jax.devices("cpu")[:8]).reshape(2, 4), ("dp", "tp"))


# --- Shapes ---------------------------------------------------------------------

def test_matmul_reduce_scatter_tokens_not_divisible():
  """30 tokens cannot be scattered over 4 shards."""
  with pytest.raises(ValueError, match=r"matmul_reduce_scatter: `x` has 30 tokens, "
                     r"which is not divisible by the size 4 of axis 'tp'"):
    _trace_in_shard_map(lambda x, w: matmul_reduce_scatter(x, w, "tp"),
                        (P(None, "tp"), P("tp", None)), (30, 16), (16, 8))


def test_row_parallel_dense_tokens_not_divisible():
  """The first dimension (tokens) must divide, even where tokens * s would."""
  with pytest.raises(ValueError, match=r"row_parallel_dense: `h` has 6 tokens \(first "
                     r"dimension\), which is not divisible by the size 4 of axis 'tp'"):
    _trace_in_shard_map(lambda h, k: dense.row_parallel_dense(h, k, axis_name="tp"),
                        (P(None, None, "tp"), P("tp", None)), (6, 2, 16), (16, 8))


@pytest.mark.parametrize("layer, name", [
    (lambda x, mesh, **kw: sharded.column_parallel_dense(
        x, _spec((16, 8)), mesh=mesh, **kw), "x"),
    (lambda x, mesh, **kw: sharded.row_parallel_dense(
        x, _spec((16, 8)), mesh=mesh, **kw), "h"),
    (lambda x, mesh, **kw: sharded.mlp(
        x, _spec((16, 8)), _spec((8, 16)), mesh=mesh, **kw), "x"),
], ids=["column", "row", "mlp"])
def test_sharded_layers_tokens_not_divisible(layer, name):
  """Global tokens must divide over the tensor-parallel axis, and over data x
  tensor-parallel shards with data parallelism."""
  with pytest.raises(ValueError, match=rf"`{name}` has 30 tokens \(first dimension\), "
                     r"which is not divisible by the size 4 of axis 'tp'"):
    jax.eval_shape(lambda x: layer(x, cpu_mesh(4)), _spec((30, 16)))
  with pytest.raises(ValueError, match=rf"`{name}` has 36 tokens \(first dimension\), "
                     r"which is not divisible by the size 8 of axis 'dp\*tp'"):
    jax.eval_shape(lambda x: layer(x, _mesh_2d(), data_axes=("dp",)), _spec((36, 16)))


@pytest.mark.parametrize("transpose_w, w_shape, layout", [
    (False, (12, 8), r"\[in_features, out_features\] has 12 input features"),
    (True, (8, 12), r"\[out_features, in_features\] has 12 input features"),
], ids=["w", "wT"])
def test_inner_dimensions_differ(transpose_w, w_shape, layout):
  """x's features must equal w's input features, in either weight layout."""
  with pytest.raises(ValueError, match=r"all_gather_matmul: inner dimensions differ: "
                     r"`x` has 16 features but `w` " + layout):
    _trace_in_shard_map(
        lambda x, w: all_gather_matmul(x, w, "tp", transpose_w=transpose_w),
        (P("tp"), P()), (16, 16), w_shape)


def test_sharded_kernel_inner_dimension_and_split():
  """A global kernel must match the input's features and split over 'tp'."""
  mesh = cpu_mesh(4)
  with pytest.raises(ValueError, match=r"sharded.column_parallel_dense: inner dimensions "
                     r"differ: the input has 16 features but `kernel` has 12"):
    jax.eval_shape(lambda x, k: sharded.column_parallel_dense(x, k, mesh=mesh),
                   _spec((16, 16)), _spec((12, 8)))
  with pytest.raises(ValueError, match=r"`kernel` has 30 output features, which is not "
                     r"divisible by the size 4 of axis 'tp'"):
    jax.eval_shape(lambda x, k: sharded.column_parallel_dense(x, k, mesh=mesh),
                   _spec((16, 16)), _spec((16, 30)))
  with pytest.raises(ValueError, match=r"sharded.mlp: `fc2_kernel` must have shape "
                     r"\(32, 16\) \(fc1_kernel transposed\), got \(16, 32\)"):
    jax.eval_shape(lambda x, a, b: sharded.mlp(x, a, b, mesh=mesh),
                   _spec((16, 16)), _spec((16, 32)), _spec((16, 32)))


@pytest.mark.parametrize("x_shape, w_shape, match", [
    ((4, 4, 16), (16, 8), r"`x` must be 2-D \[tokens, features\], got shape \(1, 4, 16\)"),
    ((16, 16), (16,), r"`w` must be 2-D \[in_features, out_features\], got shape \(16,\)"),
], ids=["x_3d", "w_1d"])
def test_wrong_rank(x_shape, w_shape, match):
  """The collective matmuls take 2-D x and w (the layers flatten extra dims)."""
  with pytest.raises(ValueError, match=r"all_gather_matmul: " + match):
    _trace_in_shard_map(lambda x, w: all_gather_matmul(x, w, "tp"),
                        (P("tp"), P()), x_shape, w_shape)


def test_layer_input_needs_two_dimensions():
  """The layers take [tokens, ..., features]; a 1-D input is refused."""
  with pytest.raises(ValueError, match=r"column_parallel_dense: `x` must have at least "
                     r"2 dimensions \[tokens, ..., features\], got shape \(4,\)"):
    _trace_in_shard_map(lambda x, k: dense.column_parallel_dense(x, k, axis_name="tp"),
                        (P("tp"), P()), (16,), (16, 8))


@pytest.mark.parametrize("layer, bias_shape, match", [
    ("column", (32,), r"column_parallel_dense: `bias` must have shape \(8,\)"),
    ("row", (9,), r"row_parallel_dense: `bias` must have shape \(8,\)"),
])
def test_bias_of_wrong_shape(layer, bias_shape, match):
  """A bias must match the kernel's (local) output features."""
  if layer == "column":
    local = lambda x, k, b: dense.column_parallel_dense(x, k, b, axis_name="tp")  # noqa: E731
    specs, shapes = (P("tp"), P(None, "tp"), P()), ((16, 16), (16, 32))
  else:
    local = lambda h, k, b: dense.row_parallel_dense(h, k, b, axis_name="tp")  # noqa: E731
    specs, shapes = (P(None, "tp"), P("tp"), P()), ((16, 16), (16, 8))
  with pytest.raises(ValueError, match=match + rf" to match the kernel's output "
                     rf"features, got \({bias_shape[0]},\)"):
    _trace_in_shard_map(local, specs, *shapes, bias_shape)


# --- Dtypes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, jnp.float64],
                         ids=["int32", "complex64", "float64"])
def test_unsupported_dtype(dtype):
  """Only bfloat16, float16 and float32 are supported."""
  with jax.enable_x64(dtype == jnp.float64):
    with pytest.raises(TypeError, match=rf"all_gather_matmul: `x` has dtype "
                       rf"{jnp.dtype(dtype).name}; supported dtypes are bfloat16, "
                       r"float16, float32"):
      _trace_in_shard_map(lambda x, w: all_gather_matmul(x, w, "tp"),
                          (P("tp"), P()), (16, 16), (16, 8), dtype=dtype)


def test_mismatched_dtypes():
  """x and w must have the same dtype; the message says which is which."""
  with pytest.raises(TypeError, match=r"matmul_reduce_scatter: `x` \(float32\) and `w` "
                     r"\(bfloat16\) must have the same dtype"):
    _trace_in_shard_map(lambda x, w: matmul_reduce_scatter(x, w, "tp"),
                        (P(None, "tp"), P("tp")), ((16, 16), F32),
                        ((16, 8), jnp.bfloat16))


def test_transpose_w_must_be_bool():
  with pytest.raises(TypeError, match=r"all_gather_matmul: `transpose_w` must be True or "
                     r"False, got 'yes'"):
    _trace_in_shard_map(lambda x, w: all_gather_matmul(x, w, "tp", transpose_w="yes"),
                        (P("tp"), P()), (16, 16), (16, 8))


# --- Axes and meshes ------------------------------------------------------------

def test_axis_not_in_enclosing_shard_map():
  """The axis must be bound by the enclosing shard_map; the message lists its axes."""
  with pytest.raises(ValueError, match=r"all_gather_matmul: axis_name='model' is not an "
                     r"axis of the enclosing jax.shard_map \(the enclosing mesh has axes "
                     r"\('tp',\)\)"):
    _trace_in_shard_map(lambda x, w: all_gather_matmul(x, w, "model"),
                        (P("tp"), P()), (16, 16), (16, 8))


def test_axis_outside_any_shard_map():
  """Called outside shard_map, the message says no axis is bound."""
  with pytest.raises(ValueError, match=r"matmul_reduce_scatter: axis_name='tp' is not "
                     r"an axis .*no mesh axis is bound here.*call it inside jax.shard_map"):
    jax.eval_shape(lambda x, w: matmul_reduce_scatter(x, w, "tp"),
                   _spec((16, 16)), _spec((16, 8)))


def test_axis_name_must_be_a_string():
  with pytest.raises(TypeError, match=r"row_parallel_dense: axis_name must be a mesh axis "
                     r"name \(str\), got \('tp',\)"):
    _trace_in_shard_map(lambda h, k: dense.row_parallel_dense(h, k, axis_name=("tp",)),
                        (P(None, "tp"), P("tp")), (16, 16), (16, 8))


def test_sharded_axis_not_in_mesh():
  """The sharded layers name the mesh's axes."""
  with pytest.raises(ValueError, match=r"sharded.mlp: axis_name='model' is not an axis "
                     r"of the mesh, whose axes are \('tp',\)"):
    jax.eval_shape(lambda x, a, b: sharded.mlp(x, a, b, mesh=cpu_mesh(4),
                                               axis_name="model"),
                   _spec((16, 16)), _spec((16, 32)), _spec((32, 16)))


def test_data_axes_not_in_mesh():
  with pytest.raises(ValueError, match=r"sharded.row_parallel_dense: data_axes=\('dp',\) "
                     r"names 'dp', which is not an axis of the mesh, whose axes are "
                     r"\('tp',\)"):
    jax.eval_shape(lambda h, k: sharded.row_parallel_dense(
        h, k, mesh=cpu_mesh(4), data_axes=("dp",)), _spec((16, 16)), _spec((16, 8)))


def test_data_axes_contain_tensor_parallel_axis():
  with pytest.raises(ValueError, match=r"sharded.mlp: data_axes=\('dp', 'tp'\) must not "
                     r"contain the tensor-parallel axis 'tp'"):
    jax.eval_shape(lambda x, a, b: sharded.mlp(x, a, b, mesh=_mesh_2d(),
                                               data_axes=("dp", "tp")),
                   _spec((16, 16)), _spec((16, 32)), _spec((32, 16)))


def test_sharded_layer_without_mesh():
  """mesh=None outside ``jax.set_mesh`` says how to give one."""
  with pytest.raises(ValueError, match=r"sharded.column_parallel_dense: no mesh: pass "
                     r"mesh=jax.sharding.Mesh\(...\) or call under `with jax.set_mesh"):
    jax.eval_shape(lambda x, k: sharded.column_parallel_dense(x, k),
                   _spec((16, 16)), _spec((16, 8)))


@pytest.mark.parametrize("layer, spec, needs", [
    ("column", P("tp", None), "P(None, 'tp') (sharded along the output features)"),
    ("row", P(None, "tp"), "P('tp', None) (sharded along the input features)"),
])
def test_kernel_sharded_along_wrong_axis(layer, spec, needs):
  """A concrete kernel placed on the mesh with the wrong split is refused
  (shard_map would otherwise reshard it on every call)."""
  mesh = cpu_mesh(4)
  kernel = jax.device_put(jnp.zeros((16, 16)), NamedSharding(mesh, spec))
  x = jnp.zeros((16, 16))
  fn = sharded.column_parallel_dense if layer == "column" else sharded.row_parallel_dense
  with pytest.raises(ValueError, match=re.escape(
      f"`kernel` is sharded as {spec!r}, but this layer needs {needs}; reshard it "
      "with jax.device_put")):
    fn(x, kernel, mesh=mesh)


# --- Configuration --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="tpu"), r"CommGemmConfig.backend must be one of \('auto', 'cublasmp', "
                          r"'xla', 'ring'\) or a Backend instance, got 'tpu'"),
    (dict(backend=object()), r"CommGemmConfig.backend must be one of .* or a Backend "
                             r"instance, got <object"),
    (dict(all_gather_algorithm="fastest"),
     r"CommGemmConfig.all_gather_algorithm must be one of \('default', 'split_p2p', "
     r".*'pipelined_ce'\), got 'fastest'"),
    (dict(reduce_scatter="tree"),
     r"CommGemmConfig.reduce_scatter must be one of \('xla', .*'default', .*\), got 'tree'"),
    (dict(reuse_gathered=True), r"CommGemmConfig.reuse_gathered must be None \(reuse "
                                r"where the self-test passed\) or False, got True"),
], ids=["backend", "backend_object", "algorithm", "reduce_scatter", "reuse_true"])
def test_bad_config(kwargs, match):
  """CommGemmConfig refuses bad values when it is built."""
  with pytest.raises(ValueError, match=match):
    CommGemmConfig(**kwargs)


def test_bad_backend_environment_variable():
  """JAX_COMM_GEMM_BACKEND with a bad value is refused where the settings are
  read, naming the variable."""
  with pytest.raises(ValueError, match=r"environment variable JAX_COMM_GEMM_BACKEND='cuda': "
                                       r"allowed values are \('auto', 'cublasmp', 'xla', "
                                       r"'ring'\)"):
    Settings.from_environ({"JAX_COMM_GEMM_BACKEND": "cuda"})


def test_valid_arguments_trace():
  """The control: the same helpers with valid arguments trace without error."""
  out = _trace_in_shard_map(lambda x, w: matmul_reduce_scatter(x, w, "tp"),
                            (P(None, "tp"), P("tp", None)), (32, 16), (16, 8))
  assert out.shape == (8, 8)
  out = jax.eval_shape(lambda x, a, b: sharded.mlp(x, a, b, mesh=_mesh_2d(),
                                                   data_axes=("dp",)),
                       _spec((16, 16)), _spec((16, 32)), _spec((32, 16)))
  assert out.shape == (16, 16)


# --- The shared config and flag checks -------------------------------------------

@pytest.mark.parametrize("config", ["xla", None, 1, {"backend": "xla"}])
def test_check_config_names_config(config):
  with pytest.raises(TypeError, match=r"where: `config` must be a jax_comm_gemm\.CommGemmConfig"):
    check_config("where", config)


def test_check_config_accepts_a_config():
  check_config("where", CommGemmConfig(backend="xla"))


@pytest.mark.parametrize("value", [0, 1, None, "no", np.int64(1), np.array([True])])
def test_check_flag_refuses_non_bools(value):
  with pytest.raises(TypeError, match=r"where: `keep_gathered_input` must be True or False"):
    validation.check_flag("where", "keep_gathered_input", value)


@pytest.mark.parametrize("value, expected", [(True, True), (False, False),
                                             (np.True_, True), (np.False_, False)])
def test_check_flag_returns_a_python_bool(value, expected):
  out = validation.check_flag("where", "flag", value)
  assert out is expected


# --- precision -------------------------------------------------------------------

HIGHEST = jax.lax.Precision.HIGHEST
PRECISIONS = [None, "highest", "default", "DEFAULT", "float32", HIGHEST, (HIGHEST, "high"),
              ("high", "default"), [HIGHEST, HIGHEST], "BF16_BF16_F32",
              jax.lax.DotAlgorithmPreset.F32_F32_F32, "HIGHEST", "best", 2, True,
              ("high",), ("high", "high", "high"), ("bad", "high")]


def _jax_takes(precision) -> bool:
  try:
    jax.eval_shape(lambda a: jax.lax.dot(a, a, precision=precision), _spec((2, 2)))
  except (ValueError, TypeError):
    return False
  return True


@pytest.mark.parametrize("precision", PRECISIONS, ids=repr)
def test_check_precision_takes_what_jax_takes(precision):
  """What jax.lax.dot takes, a list pair as its tuple (jit keys on it: it must hash)."""
  as_taken = tuple(precision) if isinstance(precision, list) else precision
  if _jax_takes(as_taken):
    assert validation.check_precision("where", precision) == as_taken
  else:
    with pytest.raises(ValueError, match=r"where: `precision` must be None, a jax.lax.Precision"):
      validation.check_precision("where", precision)


ENTRY_POINTS = {
    "all_gather_matmul": lambda p: _trace_in_shard_map(
        lambda x, w: all_gather_matmul(x, w, "tp", precision=p),
        (P("tp"), P(None, "tp")), (16, 8), (8, 8)),
    "dense.column_parallel_dense": lambda p: _trace_in_shard_map(
        lambda x, w: dense.column_parallel_dense(x, w, axis_name="tp", precision=p),
        (P("tp"), P(None, "tp")), (16, 8), (8, 8)),
    "sharded.row_parallel_dense": lambda p: jax.eval_shape(
        lambda h, w: sharded.row_parallel_dense(h, w, mesh=cpu_mesh(4), precision=p),
        _spec((16, 8)), _spec((8, 8))),
    "BlockOptions": lambda p: transformer.BlockOptions(2, precision=p),
    "linen.ColumnParallelDense": lambda p: jcg.linen.ColumnParallelDense(
        4, mesh=cpu_mesh(1), precision=p).init(jax.random.key(0), jnp.ones((2, 3))),
    "nnx.RowParallelDense": lambda p: jcg.nnx.RowParallelDense(
        4, 3, mesh=cpu_mesh(1), precision=p, rngs=flax.nnx.Rngs(0)),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_checks_precision(entry):
  with pytest.raises(ValueError, match=r"`precision` must be None"):
    ENTRY_POINTS[entry]("HIGHEST")  # jax's name is "highest"
  ENTRY_POINTS[entry]("highest")


def _connected_stand_in(mesh):
  REGISTRY.publish(stand_in_plan(cublasmp=True).with_axis(mesh, "tp", 7, {}))


def test_auto_leaves_the_fused_ops_to_xla_for_a_precision_they_would_ignore():
  """The fused ops compute in float32 whatever `precision` says: backend="auto"
  runs such a layer on XLA, saying why; "cublasmp" refuses it by name."""
  mesh = cpu_mesh(2)
  _connected_stand_in(mesh)
  config = CommGemmConfig()
  assert not isinstance(resolve_backend(config, "tp", mesh), XlaBackend)  # fused otherwise
  assert not isinstance(resolve_backend(config, "tp", mesh, precision="default"), XlaBackend)
  choice = jcg.backends.choose_backend(config, "tp", mesh, precision=HIGHEST)
  assert isinstance(choice.backend, XlaBackend) and "precision=" in choice.reason
  with pytest.raises(ValueError, match=r"backend='cublasmp': precision='highest' would be "
                                       r"ignored"):
    resolve_backend(CommGemmConfig(backend="cublasmp"), "tp", mesh, precision="highest")
  f = jax.shard_map(lambda x, w: all_gather_matmul(x, w, "tp", precision=HIGHEST), mesh=mesh,
                    in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
  jaxpr = str(jax.make_jaxpr(f)(jnp.ones((16, 8)), jnp.ones((8, 8))))
  assert TARGETS["all_gather_matmul"] not in jaxpr and "Precision.HIGHEST" in jaxpr


def test_fp8_refuses_a_precision_it_would_ignore():
  """FP8 GEMMs accumulate as the recipe says: a precision there is an error."""
  config = CommGemmConfig(backend="xla", fp8=Fp8Recipe())
  run = lambda p: _trace_in_shard_map(
      lambda x, w: all_gather_matmul(x, w, "tp", precision=p, config=config),
      (P("tp"), P(None, "tp")), (16, 16), (16, 16))
  with pytest.raises(ValueError, match=r"precision=Precision.HIGHEST would be ignored: .*FP8"):
    run(HIGHEST)
  run(jax.lax.Precision.DEFAULT)


# --- the autotune cache ------------------------------------------------------------

def test_an_autotune_cache_that_cannot_be_a_file_is_refused_by_name(tmp_path):
  """A directory, or a path under a regular file, is refused where the settings
  are read, not when autotune writes its choices after measuring."""
  (tmp_path / "file").write_text("")
  for bad in (tmp_path, tmp_path / "file" / "autotune.json",
              tmp_path / "file" / "deeper" / "autotune.json"):
    with pytest.raises(ValueError, match=r"environment variable JAX_COMM_GEMM_AUTOTUNE_CACHE="):
      Settings.from_environ({"JAX_COMM_GEMM_AUTOTUNE_CACHE": str(bad)})
  for good in (tmp_path / "new" / "autotune.json", tmp_path / "file", ""):
    assert Settings.from_environ({"JAX_COMM_GEMM_AUTOTUNE_CACHE": str(good)}).autotune_cache \
        == str(good)


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path):
  from jax_comm_gemm.backends import tuning
  (tmp_path / "d").mkdir()
  for path, cache in ((tmp_path / "a.json", {"x": object()}),  # json.dump fails
                      (tmp_path / "d", {"x": 1})):  # os.replace fails: a directory
    with pytest.raises((TypeError, OSError)):
      tuning.save_cache(str(path), cache)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
  tuning.save_cache(str(tmp_path / "a.json"), {"x": 1})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "d"]
