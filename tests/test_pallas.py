"""jax's Pallas Mosaic GPU kernel as an implementation of ``auto``: where it
can run (each limit names itself), what its backend runs where it cannot,
and how autotune leaves it out there. The kernel itself runs only on Hopper
GPUs: tests/gpu/checks.py::check_pallas."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_comm_gemm.backends.pallas as pallas
import jax_comm_gemm.backends.tuning as autotune
from conftest import stand_in_plan, cpu_mesh
from jax_comm_gemm.backends import routes
from jax_comm_gemm.backends.routes import AG, RS, Problem
from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.diagnostics import hlo, report
from jax_comm_gemm.runtime import REGISTRY, settings
from jax_comm_gemm.runtime.constants import TARGETS

H200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
A100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")


@pytest.fixture
def gpus(monkeypatch):
  """Pretends to be a job of `devices` GPUs of `kind` over `processes` processes."""
  def pretend(kind=H200, devices=2, processes=2):
    monkeypatch.setattr(jax, "devices", lambda *a: [kind] * devices)
    monkeypatch.setattr(jax, "device_count", lambda *a: devices)
    monkeypatch.setattr(jax, "process_count", lambda *a: processes)
  return pretend


def supports(rows=2048, k=4096, m=2048, dtype="bfloat16", transpose_w=False, gathered=False,
             axis_size=2):
  return pallas.supports(rows, k, m, dtype, transpose_w, gathered, axis_size)


def test_supported_on_hopper_over_every_gpu_in_either_process_mode(gpus):
  gpus(processes=1)
  assert supports().ok
  gpus(processes=2)
  assert supports().ok and supports(dtype="float16").ok


@pytest.mark.parametrize("kw, says", [
    (dict(transpose_w=True), "w is transposed"),
    (dict(gathered=True), "does not hand out the gathered operand"),
    (dict(dtype="float32"), "runs bfloat16 and float16, not float32"),
    (dict(rows=2048 + 64), "rows 2112 by 128"),
    (dict(m=2048 + 128), "columns 2176 by 256"),
    (dict(k=4096 + 32), "k 4128 by 64"),
    (dict(axis_size=4), "must span all 2 devices (it has 4)"),
    (dict(axis_size=1), "a group of one gathers nothing"),
])
def test_each_limit_names_itself(gpus, kw, says):
  gpus()
  verdict = supports(**kw)
  assert not verdict.ok and says in verdict.reason


def test_not_on_other_gpus_nor_odd_process_layouts(gpus):
  gpus(kind=A100)
  assert "Hopper GPUs (compute capability 9.x), not on NVIDIA A100" in supports().reason
  gpus(devices=8, processes=4)
  assert supports(axis_size=8).reason == "it needs one process per GPU or one process for all"


def test_a_jax_without_the_kernel_is_a_reason_not_an_error(gpus, monkeypatch):
  gpus()
  monkeypatch.setattr(pallas, "_kernel", lambda: (None, "jax's kernel is not there (gone)"))
  assert supports().reason == "jax's kernel is not there (gone)"


def test_this_jax_has_the_kernel_with_the_configuration_it_takes():
  kernel, config = pallas._kernel()
  assert callable(kernel), config
  assert (config.tile_m, config.tile_n, config.tile_k) == (pallas.TILE_M, pallas.TILE_N,
                                                           pallas.TILE_K)


def test_where_it_cannot_run_the_backend_runs_xlas_ops():
  """On CPU: no kernel in the program, and AG(x) @ w (and the gathered x)."""
  mesh = cpu_mesh(2)
  x = jax.random.normal(jax.random.key(0), (512, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (128, 512), jnp.float32)

  def local(x, w):
    return pallas.PallasBackend().all_gather_matmul(x, w, "tp", transpose_w=False,
                                                    return_gathered=True)

  program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                  out_specs=(P(None, "tp"), P("tp"))))
  assert "mosaic_gpu" not in program.lower(x, w).as_text()  # the kernel's custom call
  y, g = program(x, w)
  np.testing.assert_allclose(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                             rtol=2e-5, atol=2e-5)
  # Each rank gathered all of x: a copy of its bytes, exact.
  np.testing.assert_array_equal(g, np.concatenate([x, x]))


def test_auto_knows_it_only_for_the_all_gather():
  assert pallas.NAME in routes.CANDIDATES[AG] and pallas.NAME not in routes.CANDIDATES[RS]
  assert isinstance(routes.implementation(pallas.NAME, None), pallas.PallasBackend)


def test_forcing_it_where_it_cannot_run_says_so():
  name, why = routes.choose(Problem(AG, 2048, 4096, 2048, "bfloat16", True, 2), "xla",
                          stand_in_plan(autotune=pallas.NAME))
  assert name == pallas.NAME
  assert why == (f"forced by {settings.AUTOTUNE}={pallas.NAME}, which runs XLA's ops here: "
                 "the kernel takes w as [k, m]; w is transposed")


def test_autotune_keeps_a_place_for_it_where_it_cannot_run():
  """Every process lists every candidate, in one order; one this process
  cannot run is None (so that the processes agree to skip it)."""
  mesh = cpu_mesh(2)
  p = Problem(AG, 256, 128, 256, "float32", False, 2)
  runs = autotune._runnables(mesh, "tp", p, 0.01, REGISTRY.plan())
  assert tuple(runs) == routes.CANDIDATES[AG]
  assert runs[pallas.NAME] is None
  assert all(run is not None for name, run in runs.items() if name != pallas.NAME)


def test_a_candidate_that_cannot_run_here_is_skipped_everywhere_without_a_warning(caplog):
  agreed = []

  def agree(failed):
    agreed.append(dict(failed))
    return failed

  times = autotune.time_candidates({"a": (lambda: 0, 1), "absent": None}, rounds=2,
                                   wait=lambda out: None, agree=agree)
  assert agreed[0] == {"absent": "cannot run here"} and not any(agreed[1:])
  assert times["absent"] == math.inf and math.isfinite(times["a"])
  assert "absent" not in caplog.text


def test_auto_asks_it_about_the_problem_as_the_kernel_sees_it(gpus):
  """A problem's rows, k and m (the rank's output columns) reach supports()
  in their places."""
  gpus()
  assert routes.runnable(pallas.NAME, Problem(AG, 2048, 4096, 2048, "bfloat16", False, 2),
                         REGISTRY.plan()).ok
  verdict = routes.runnable(pallas.NAME, Problem(AG, 2048, 4096, 2176, "bfloat16", False, 2),
                            REGISTRY.plan())
  assert "columns 2176 by 256" in verdict.reason
  assert "rows 2112" in routes.runnable(
      pallas.NAME, Problem(AG, 2112, 4096, 2048, "bfloat16", False, 2), REGISTRY.plan()).reason
  assert routes.runnable("ring", Problem(AG, 2112, 4096, 2048, "float32", True, 2, True),
                         REGISTRY.plan()).ok


def test_the_report_names_the_kernel_where_a_layer_can_run_it(gpus):
  """A PallasBackend given as the layers' backend: the column-parallel layer's
  AllGather+GEMM is the kernel's; a kept input, the row-parallel layer's
  transposed kernel and another GPU are XLA's ops, each with its reason."""
  mesh = cpu_mesh(2)
  config = CommGemmConfig(backend=pallas.PallasBackend())
  path = lambda **kw: report.layer_path(config, mesh, "tp", jnp.bfloat16, **kw)
  gpus()
  assert path().path == report.PALLAS_KERNEL
  assert "where its tiles divide the shape" in path().reason
  for kw, why in ((dict(keep_gathered_input=True), "does not hand out the gathered operand"),
                  (dict(reduce_scatter_layer=True), "w is transposed")):
    assert path(**kw).path == report.XLA_FALLBACK and why in path(**kw).reason
  # Its weight gradients gather again, as XLA's do: the fallback's counts.
  counts = report.expected_all_gathers(config, mesh, "tp", jnp.bfloat16)
  assert (counts.standalone_all_gathers, counts.fused_all_gather_matmuls) == (2, 0)
  gpus(kind=A100)
  assert path().path == report.XLA_FALLBACK
  assert path().reason == ("a Backend instance was given; the Pallas kernel cannot run it: "
                           "it runs on Hopper GPUs (compute capability 9.x), not on NVIDIA A100")


def test_compiled_counts_tell_mosaic_kernels_from_the_fused_calls():
  def call(target):
    return (f"  %c = bf16[256,512]{{1,0}} custom-call(bf16[128,512]{{1,0}} %x, "
            f"bf16[512,256]{{1,0}} %w), custom_call_target=\"{target}\"")

  text = "\n".join([call("mosaic_gpu_v2"), call("mosaic_gpu_v2"),
                    call(TARGETS["all_gather_matmul"]), call("not_mosaic_gpu")])
  counts = hlo.count_collectives(text)
  assert (counts.mosaic_gpu_kernels, counts.fused_all_gather_matmul) == (2, 1)
  assert counts.all_gather == 0
