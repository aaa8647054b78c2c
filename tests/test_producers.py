"""benchmarks/producers.py on the optimized HLO of a small FP8 training step
compiled here (CPU), with a synthetic trace whose "XLA Ops" line names some of
its instructions: each piece of work lands in the category of what produced it."""

import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import producers  # noqa: E402

from jax_comm_gemm.fp8 import quantize  # noqa: E402


def _step_hlo() -> str:
  norm = nn.LayerNorm()

  def loss(w, x):
    h = norm.apply({"params": {"scale": jnp.ones(128), "bias": jnp.zeros(128)}}, x)
    xq, sx = quantize.quantize_tensor(h, jnp.float8_e4m3fn)
    wq, sw = quantize.quantize_tensor(w, jnp.float8_e4m3fn)
    y = jnp.dot(xq.astype(jnp.float32), wq.astype(jnp.float32)) * (sx * sw)
    with jax.named_scope("activation"):  # as the transformer block names it
      a = jax.nn.gelu(y)
    return jnp.mean(a ** 2)

  tx = optax.adam(1e-3)

  def step(w, x, state):
    g = jax.grad(loss)(w, x)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state

  w, x = jnp.ones((128, 256)), jnp.ones((64, 128))
  return jax.jit(step).lower(w, x, tx.init(w)).compile().as_text()


@pytest.fixture(scope="module")
def module():
  return producers.Module(_step_hlo())


def _named(module, category):
  return [n for n, i in module.instructions.items()
          if i["op"] == "fusion" and module.classify(n) == category]


def test_each_producer_is_found(module):
  entry = [n for n, i in module.instructions.items() if i["op"] in ("fusion", "dot")]
  found = {module.classify(n) for n in entry}
  # What a CPU compile of this step must contain: the GEMMs, the FP8 casts and
  # their amaxes, Adam's update, and the activation (found by its name scope:
  # jax.nn's frames are not in the HLO).
  assert {"gemm", "cast", "amax", "optimizer", "activation"} <= found, sorted(found)


def test_sources_walk_the_stack(module):
  frames = [i["frame"] for i in module.instructions.values() if i["frame"]]
  sources = [s for f in frames for s in module.sources(f)]
  assert any("/optax/" in s for s in sources), sources[:5]
  assert any("jax_comm_gemm/fp8/quantize.py" in s for s in sources), sources[:5]


def test_trace_time_lands_in_the_categories(module, tmp_path):
  cast, optimizer = _named(module, "cast")[0], _named(module, "optimizer")[0]
  events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
             "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "XLA Ops"}},
            {"ph": "X", "name": cast, "pid": 1, "tid": 2, "ts": 0, "dur": 30},
            {"ph": "X", "name": cast, "pid": 1, "tid": 2, "ts": 50, "dur": 10},
            {"ph": "X", "name": optimizer, "pid": 1, "tid": 2, "ts": 70, "dur": 5},
            {"ph": "X", "name": "not_in_the_hlo", "pid": 1, "tid": 2, "ts": 80, "dur": 1}]
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  s = producers.summarize(producers.xla_op_times(producers.trace_summary.load(str(path)), None),
                          module)
  by = s["categories"]
  assert (by["cast"]["us"], by["cast"]["count"]) == (40.0, 2)
  assert by["optimizer"]["us"] == 5.0 and by["other"]["us"] == 1.0
  assert s["total_us"] == 46.0
  assert "| cast | 40.0 | 87.0% | 2 |" in producers.format_table(s)


def test_kernels_named_after_instructions_or_libraries(module):
  cast = next(n for n in _named(module, "cast") if "." in n)
  assert module.classify(cast.replace(".", "_")) == "cast"  # XLA's kernel name for it
  assert module.classify(f"%{cast} = f8e4m3fn[64,128] fusion(...)") == "cast"
  assert module.classify("nvjet_sm90_tst_128x128_TNT") == "gemm"
  assert module.classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
  assert module.classify("ncclDevKernel_AllGather_RING_LL") == "collective"
  assert module.classify("some_kernel_of_no_library") == "other"


def test_a_fusion_that_only_transposes_is_a_transpose():
  text = """HloModule m

%wrapped_transpose_computation (param_0: bf16[64,128]) -> bf16[128,64] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  ROOT %transpose.1 = bf16[128,64]{1,0} transpose(%param_0), dimensions={1,0}
}

ENTRY %main (x: bf16[64,128]) -> bf16[128,64] {
  %x = bf16[64,128]{1,0} parameter(0)
  ROOT %wrapped_transpose = bf16[128,64]{1,0} fusion(%x), kind=kInput, calls=%wrapped_transpose_computation
}
"""
  module = producers.Module(text)
  assert module.classify("wrapped_transpose") == "transpose"


def test_longest_lists_what_a_row_is_made_of(module):
  """--fusions: the longest non-GEMM instructions, longest first, each with
  its category and the HLO it runs."""
  cast, optimizer = _named(module, "cast")[0], _named(module, "optimizer")[0]
  gemm = _named(module, "gemm")[0]
  times = {cast: (30.0, 2), optimizer: (50.0, 1), gemm: (500.0, 1)}
  text = producers.longest(times, module, 5)
  headers = [line for line in text.splitlines() if line.startswith("## ")]
  assert [h.split(":")[0] for h in headers] == [f"## {optimizer}", f"## {cast}"]
  assert headers[1].startswith(f"## {cast}: cast, 30 us x2")
  assert module.instructions[cast]["line"].strip()[:200] in text
  assert producers.longest(times, module, 1).count("## ") == 1
