#!/usr/bin/env python3
"""The project's side of the benchmark: the collective matmuls and the
sequence-parallel layers through jax_comm_gemm's public API, beside XLA, plain
JAX (no package code) and the GEMM-only floor, at steady state (harness.py says
how), in one process driving all local GPUs (or one process per GPU).

Ops (each one function registered with @op; `--ops` picks):
  all_gather_matmul        y = AG(x) @ w                  n x k x m (global)
  all_gather_matmul_sweep  the same over tokens at k = m = 8192
  matmul_reduce_scatter    y = RS(x @ w)                   n x k x m, k split
  row_parallel_fwd_bwd     the row-parallel layer, forward + backward  tokens x F x K
  mlp_fwd_bwd              the SP MLP, forward + backward   tokens x d x ffn
  transformer_fwd_bwd      one transformer block, forward + backward (`--transformer`)
The fwd+bwd ops take random cotangents (never a sum's constant ones). The floor
runs the same local GEMMs on pre-gathered inputs, with no communication.

Variants: auto, cublasmp_<algorithm> (split_p2p, default; for
matmul_reduce_scatter the reduce-scatter's algorithm, for the layers the
all-gather's), cublasmp_rs_<algorithm> (the layers' forward reduce-scatter;
cublasmp_rs_ring: the fused all-gather with the ring reduce-scatter;
cublasmp_rs_pipelined_ce: with the project's own GEMM+ReduceScatter), pipelined
and pipelined_ce (the project's own AllGather+GEMMs; the layers' reduce-scatter
as configured; for matmul_reduce_scatter, pipelined_ce alone: the own
GEMM+ReduceScatter), pipelined_ce_all (the project's own, both ops),
ring (backend="ring": both ops as rings of per-shard GEMMs and ppermutes), auto_no_reuse, auto_keep, xla
(backend="xla"), auto_step (auto tuned by jcg.autotune_step on the whole
step), pure_jax (autodiff of shard_map all_gather -> dot / dot -> psum_scatter),
floor. Memory of every MLP variant (`mlp_step_memory`): compiled
temp bytes, and the peak of XLA's allocator measured in a fresh process per
variant (shapes ascending; a peak an earlier, larger shape masks is reported as
null). cuBLASMp's own workspace is outside XLA's allocator; `proc_gpu_mib` is the
whole process's GPU memory from nvidia-smi after the last shape.

Modes:
  --peer windowed_einsum   XLA's windowed einsum: pure_jax with
                           --xla_gpu_threshold_for_windowed_einsum_mib=0, in this
                           process (run it in its own process; no package code)
  --profile OP:SHAPE:VARIANT  capture a jax.profiler trace of a few steps, each
                           waited for, then as many back to back, and summarise
                           both (trace_summary.py); repeatable
  --cpu-smoke              tiny shapes on 2 CPU devices, ring/xla/pure_jax/floor
  --spawn N                one process per GPU (jax.distributed on 127.0.0.1)

Examples (a GPU machine set up as docs/gpu-testing.md says):
  python3 benchmarks/bench.py --out /tmp/project.json --budget 300
  python3 benchmarks/bench.py --out /tmp/p.json --quick --ops all_gather_matmul
  python3 benchmarks/bench.py --ops none --profile ag:4096x4096x4096:auto
  JAX_PLATFORMS=cpu python3 benchmarks/bench.py --cpu-smoke --out /tmp/smoke.json

Longer than 300 lines because it is the one script run_all.sh runs for the project's side: every op is one @op function, the rest is the run's bookkeeping (budget, watchdog, resume), which splits poorly.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import fnmatch
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from functools import partial
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
from harness import parse_shape, say, shape_str, short_error  # noqa: E402

AXIS = "tp"
WINDOWED_FLAG = "--xla_gpu_threshold_for_windowed_einsum_mib=0"
AG_ALGOS = ("split_p2p", "default")  # cuBLASMp's, as the project offers them

# ----------------------------------------------------------------------------
# Op registry: adding an op is one function with @op(...).


@dataclasses.dataclass
class OpSpec:
  name: str
  build: Callable
  shapes: tuple
  quick: tuple
  smoke: tuple
  variants: tuple
  weight: float           # share of the time budget
  compile_s: float        # a guess per variant, for the budget before a shape ran
  target_ms: float        # wall time of one variant's calls in a round
  enabled: bool = True
  aliases: tuple = ()


OPS: dict[str, OpSpec] = {}


def op(name, *, shapes, quick, smoke, variants, weight, compile_s=0.5, target_ms=40.0,
       enabled=True, aliases=()):
  def register(build):
    OPS[name] = OpSpec(name, build, tuple(shapes), tuple(quick), tuple(smoke),
                       tuple(variants), weight, compile_s, target_ms, enabled, aliases)
    return build
  return register


AG_SHAPES = ((8192, 8192, 28672), (16384, 8192, 8192), (8192, 8192, 7168),
             (8192, 4096, 4096), (4096, 4096, 4096), (2048, 8192, 8192))
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)  # k = m = 8192
RS_SHAPES = ((8192, 28672, 8192), (16384, 8192, 8192), (8192, 7168, 8192),
             (8192, 4096, 4096), (4096, 4096, 4096), (2048, 8192, 8192))
AG_QUICK = ((8192, 8192, 28672), (8192, 8192, 7168), (4096, 4096, 4096))
RS_QUICK = ((8192, 28672, 8192), (4096, 4096, 4096))
# The token sweep beyond AG_SHAPES (which hold its 2048 and 16384 rows).
SWEEP_SHAPES = tuple((n, 8192, 8192) for n in SWEEP_TOKENS if (n, 8192, 8192) not in AG_SHAPES)
SWEEP_QUICK = ((1024, 8192, 8192), (32768, 8192, 8192))
# The AllGather+GEMM ops each peer runs, as (shapes, quick shapes).
PEER_AG_OPS = {"all_gather_matmul": (AG_SHAPES, AG_QUICK),
               "all_gather_matmul_sweep": (SWEEP_SHAPES, SWEEP_QUICK)}
MLP_SHAPES = ((8192, 8192, 28672), (16384, 4096, 16384), (8192, 8192, 7168),
              (4096, 4096, 16384))
# The row-parallel layer of each MLP shape (its fc2): tokens x F x K.
ROW_SHAPES = tuple((n, f, d) for n, d, f in MLP_SHAPES)

AG_VARIANTS = ("auto",) + tuple(f"cublasmp_{a}" for a in AG_ALGOS) + (
    "pipelined_ce", "ring", "xla", "pure_jax", "floor")
RS_VARIANTS = ("auto",) + tuple(f"cublasmp_{a}" for a in AG_ALGOS) + (
    "pipelined_ce", "ring", "xla", "pure_jax", "floor")
ROW_VARIANTS = ("auto", "auto_no_reuse", "cublasmp_split_p2p", "pipelined_ce",
                "ring", "cublasmp_rs_ring", "cublasmp_rs_default", "cublasmp_rs_pipelined_ce",
                "pipelined_ce_all", "xla", "pure_jax", "auto_step", "floor")
# auto_step, here and in ROW_VARIANTS (last: its step-level decision is recorded
# for the problems it meets): backend="auto" tuned with jcg.autotune_step, as the
# example does.
MLP_VARIANTS = ("auto", "auto_no_reuse", "auto_keep", "cublasmp_split_p2p", "pipelined_ce", "ring", "cublasmp_rs_ring", "cublasmp_rs_default",
                "cublasmp_rs_pipelined_ce", "pipelined_ce_all", "xla", "pure_jax", "auto_step",
                "floor")
SMOKE_VARIANTS = ("ring", "xla", "pure_jax", "floor")


class Ctx:
  """What a builder needs: the mesh, fresh random data, shard_map, configs."""

  def __init__(self, jax, mesh, seed: int):
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415
    self.jax, self.jnp, self.lax = jax, jax.numpy, jax.lax
    self.mesh, self.P, self.NamedSharding = mesh, PartitionSpec, NamedSharding
    self.seed, self.counter = seed, 0
    self._jcg = None

  @property
  def jcg(self):
    if self._jcg is None:
      self._jcg = import_jcg()
    return self._jcg

  def rand(self, shape, spec, scale=1.0):
    """Random normal bf16 (never zeros or constants), fresh per call."""
    jax, jnp = self.jax, self.jnp
    self.counter += 1
    key = jax.random.fold_in(jax.random.key(self.seed), self.counter)
    f = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16),
                out_shardings=self.NamedSharding(self.mesh, spec))
    return f(key)

  def smap(self, fn, in_specs, out_specs, check_vma=True):
    return self.jax.jit(self.jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                                           out_specs=out_specs, check_vma=check_vma))

  def config(self, variant: str, role: str):
    """(CommGemmConfig, keep_gathered_input) of a project variant. role: "ag"
    (the AllGather+GEMM alone), "rs" (the GEMM+ReduceScatter alone) or "layer"."""
    C = self.jcg.CommGemmConfig
    if variant == "auto":
      return C(), False
    if variant == "auto_no_reuse":
      return C(reuse_gathered=False), False
    if variant == "auto_keep":
      return C(), True
    if variant == "auto_step":
      return C(), False
    if variant == "xla":
      return C(backend="xla"), False
    if variant == "ring":
      return C(backend="ring"), False
    if variant == "pipelined_ce" and role == "rs":  # the own GEMM+ReduceScatter
      return C(backend="cublasmp", reduce_scatter=variant), False
    if variant == "pipelined_ce":  # the project's own AllGather+GEMM
      return C(backend="cublasmp", all_gather_algorithm=variant), False
    if variant == "pipelined_ce_all":  # the project's own, both ops
      return C(backend="cublasmp", all_gather_algorithm="pipelined_ce",
               reduce_scatter="pipelined_ce"), False
    if variant.startswith("cublasmp_rs_"):
      return C(backend="cublasmp", reduce_scatter=variant[len("cublasmp_rs_"):]), False
    if variant.startswith("cublasmp_"):
      algo = variant[len("cublasmp_"):]
      if role == "rs":
        return C(backend="cublasmp", reduce_scatter=algo), False
      return C(backend="cublasmp", all_gather_algorithm=algo), False
    raise ValueError(f"unknown variant {variant!r}")


# The project's calls, through the public API only. The config is made at trace
# time, so a variant the package refuses fails alone (as a result), not its shape.


def project_ag(ctx, name, x, w):
  cfg, keep = ctx.config(name, "ag")
  return ctx.jcg.all_gather_matmul(x, w, AXIS, transpose_w=False, return_gathered=False,
                                   keep_gathered_input=keep, config=cfg)


def project_rs(ctx, name, x, w):
  cfg, _ = ctx.config(name, "rs")
  return ctx.jcg.matmul_reduce_scatter(x, w, AXIS, transpose_w=False, config=cfg)


def project_row(ctx, name, h, w):
  cfg, _ = ctx.config(name, "layer")
  return ctx.jcg.row_parallel_dense(h, w, axis_name=AXIS, config=cfg)


def project_mlp(ctx, name, x, w1, w2):
  cfg, keep = ctx.config(name, "layer")
  return ctx.jcg.mlp(x, w1, w2, axis_name=AXIS, keep_gathered_input=keep, config=cfg)


def import_jcg():
  """jax_comm_gemm as installed (pip install -e . on the GPU machine); from the
  source tree beside benchmarks/ only where no install is found."""
  try:
    import jax_comm_gemm  # noqa: PLC0415
  except ModuleNotFoundError:
    sys.path.append(os.path.dirname(HERE))
    import jax_comm_gemm  # noqa: PLC0415
  return jax_comm_gemm


def vjp_step(jax, layer):
  """Forward + backward of `layer` with the given (random) cotangent."""
  def step(*args):
    *inputs, ct = args
    y, pullback = jax.vjp(layer, *inputs)
    return (y, *pullback(ct))
  return step


@op("all_gather_matmul", shapes=AG_SHAPES, quick=AG_QUICK,
    smoke=((256, 128, 256), (128, 64, 128)), variants=AG_VARIANTS, weight=20,
    compile_s=0.4, target_ms=30.0, aliases=("ag",))
def build_all_gather_matmul(ctx: Ctx, shape, names):
  n, k, m = shape
  P, lax = ctx.P, ctx.lax
  x = ctx.rand((n, k), P(AXIS))
  w = ctx.rand((k, m), P(None, AXIS), k ** -0.5)
  fns, args = {}, {}
  for name in names:
    if name == "floor":
      xg = ctx.rand((n, k), P())
      fns[name] = ctx.smap(lambda xg, w: xg @ w, (P(), P(None, AXIS)), P(None, AXIS), False)
      args[name] = (xg, w)
      continue
    if name in ("pure_jax", "windowed_einsum"):
      body = lambda x, w: lax.all_gather(x, AXIS, axis=0, tiled=True) @ w  # noqa: E731
    else:
      body = partial(project_ag, ctx, name)
    fns[name] = ctx.smap(body, (P(AXIS), P(None, AXIS)), P(None, AXIS))
    args[name] = (x, w)
  return fns, args


op("all_gather_matmul_sweep",
   shapes=SWEEP_SHAPES, quick=SWEEP_QUICK, smoke=((64, 128, 128), (512, 128, 128)),
   variants=("auto", "cublasmp_split_p2p", "ring", "xla", "floor"), weight=8, compile_s=0.4,
   target_ms=30.0, aliases=("sweep",))(build_all_gather_matmul)


@op("matmul_reduce_scatter", shapes=RS_SHAPES, quick=RS_QUICK,
    smoke=((256, 128, 256),), variants=RS_VARIANTS, weight=14, compile_s=0.4,
    target_ms=30.0, aliases=("rs",))
def build_matmul_reduce_scatter(ctx: Ctx, shape, names):
  n, k, m = shape
  P, lax = ctx.P, ctx.lax
  x = ctx.rand((n, k), P(None, AXIS))
  w = ctx.rand((k, m), P(AXIS, None), k ** -0.5)
  specs = (P(None, AXIS), P(AXIS, None))
  fns, args = {}, {}
  for name in names:
    args[name] = (x, w)
    if name == "floor":  # the local GEMM, no reduce-scatter
      fns[name] = ctx.smap(lambda x, w: x @ w, specs, P(AXIS), False)
      continue
    if name in ("pure_jax", "windowed_einsum"):
      body = lambda x, w: lax.psum_scatter(x @ w, AXIS, scatter_dimension=0, tiled=True)  # noqa: E731
    else:
      body = partial(project_rs, ctx, name)
    fns[name] = ctx.smap(body, specs, P(AXIS))
  return fns, args


@op("row_parallel_fwd_bwd", shapes=ROW_SHAPES, quick=((8192, 7168, 8192),),
    smoke=((256, 256, 128),), variants=ROW_VARIANTS, weight=12, compile_s=0.8,
    target_ms=60.0, aliases=("row",))
def build_row_parallel(ctx: Ctx, shape, names):
  n, f, d = shape
  P, lax, jax = ctx.P, ctx.lax, ctx.jax
  h = ctx.rand((n, f), P(None, AXIS))
  w = ctx.rand((f, d), P(AXIS, None), f ** -0.5)
  ct = ctx.rand((n, d), P(AXIS))
  out_specs = (P(AXIS), P(None, AXIS), P(AXIS, None))
  fns, args = {}, {}
  for name in names:
    if name == "floor":
      ct_full = ctx.rand((n, d), P())
      fns[name] = ctx.smap(vjp_step(jax, lambda h, w: h @ w),
                           (P(None, AXIS), P(AXIS, None), P()), out_specs, False)
      args[name] = (h, w, ct_full)
      continue
    if name in ("pure_jax", "windowed_einsum"):
      layer = lambda h, w: lax.psum_scatter(h @ w, AXIS, scatter_dimension=0, tiled=True)  # noqa: E731
    else:
      layer = partial(project_row, ctx, name)
    fns[name] = ctx.smap(vjp_step(jax, layer), (P(None, AXIS), P(AXIS, None), P(AXIS)),
                         out_specs)
    args[name] = (h, w, ct)
  return fns, args


def pure_jax_mlp(lax, jax, x, w1, w2):
  """What a JAX user writes without this project; autodiff does the rest."""
  h = lax.all_gather(x, AXIS, axis=0, tiled=True) @ w1
  return lax.psum_scatter(jax.nn.gelu(h) @ w2, AXIS, scatter_dimension=0, tiled=True)


def floor_mlp(jax, x, w1, w2):
  """The MLP floor's layer: the same block on tokens already gathered, so the
  step has the block's GEMMs and element-wise work and nothing to communicate
  (floor_probe.py sets it beside its GEMMs alone)."""
  return jax.nn.gelu(x @ w1) @ w2


@op("mlp_fwd_bwd", shapes=MLP_SHAPES, quick=((8192, 8192, 7168), (4096, 4096, 16384)),
    smoke=((256, 128, 256),), variants=MLP_VARIANTS, weight=26, compile_s=1.5,
    target_ms=80.0, aliases=("mlp",))
def build_mlp(ctx: Ctx, shape, names):
  n, d, f = shape
  P, lax, jax = ctx.P, ctx.lax, ctx.jax
  x = ctx.rand((n, d), P(AXIS))
  w1 = ctx.rand((d, f), P(None, AXIS), d ** -0.5)
  w2 = ctx.rand((f, d), P(AXIS, None), f ** -0.5)
  ct = ctx.rand((n, d), P(AXIS))
  out_specs = (P(AXIS), P(AXIS), P(None, AXIS), P(AXIS, None))
  fns, args = {}, {}
  for name in names:
    if name == "floor":  # the same six GEMMs on pre-gathered tokens
      xg, ct_full = ctx.rand((n, d), P()), ctx.rand((n, d), P())
      fns[name] = ctx.smap(vjp_step(jax, partial(floor_mlp, jax)),
                           (P(), P(None, AXIS), P(AXIS, None), P()), out_specs, False)
      args[name] = (xg, w1, w2, ct_full)
      continue
    if name in ("pure_jax", "windowed_einsum"):
      layer = partial(pure_jax_mlp, lax, jax)
    else:
      layer = partial(project_mlp, ctx, name)
    fns[name] = ctx.smap(vjp_step(jax, layer),
                         (P(AXIS), P(None, AXIS), P(AXIS, None), P(AXIS)), out_specs)
    args[name] = (x, w1, w2, ct)
  return fns, args


@op("transformer_fwd_bwd", shapes=((8192, 8192, 28672), (8192, 4096, 16384)),
    quick=((8192, 4096, 16384),), smoke=((256, 128, 256),),
    variants=("auto", "auto_keep", "pipelined_ce_all", "ring", "xla", "floor"), weight=15,
    compile_s=3.0, target_ms=150.0, enabled=False, aliases=("transformer",))
def build_transformer(ctx: Ctx, shape, names):
  """One sequence-parallel transformer block (layers/transformer.py), forward +
  backward, batch 1: shape is (sequence, d_model, MLP width); heads of 128
  (at least one per GPU). Floor: the same local GEMMs and attention on the
  pre-gathered sequence, no communication."""
  from jax_comm_gemm.layers import transformer as T  # noqa: PLC0415  (after import_jcg)
  seq, d, f = shape
  P, jax = ctx.P, ctx.jax
  tp = ctx.mesh.shape[AXIS]
  heads = max(tp, d // 128)
  layout = T.param_layout(d, f, AXIS)
  params = jax.tree.map(
      lambda p: ctx.rand(p.shape, P(*p.names), p.shape[0] ** -0.5 if len(p.shape) == 2
                         else 0.1),
      layout, is_leaf=lambda v: isinstance(v, T.ParamSpec))
  specs = jax.tree.map(lambda p: P(*p.names), layout,
                       is_leaf=lambda v: isinstance(v, T.ParamSpec))
  x = ctx.rand((seq, 1, d), P(AXIS))
  ct = ctx.rand((seq, 1, d), P(AXIS))
  fns, args = {}, {}
  for name in names:
    if name == "floor":
      options = T.BlockOptions(num_heads=heads)

      def floor_block(x, params, options=options):
        dense = lambda h, p: h @ p["kernel"] + p["bias"]  # noqa: E731
        h = T.layer_norm(x, params["ln_1"], options.epsilon, x.dtype)
        h = T.attention(dense(h, params["attention"]["qkv"]), heads // tp, True, None)
        x = x + dense(h, params["attention"]["out"])
        h = T.layer_norm(x, params["ln_2"], options.epsilon, x.dtype)
        return x + dense(jax.nn.gelu(dense(h, params["mlp"]["fc1"])), params["mlp"]["fc2"])

      xg, ct_full = ctx.rand((seq, 1, d), P()), ctx.rand((seq, 1, d), P())
      fns[name] = ctx.smap(vjp_step(jax, floor_block), (P(), specs, P()), (P(), P(), specs),
                           False)
      args[name] = (xg, params, ct_full)
      continue
    config, keep = ctx.config(name, "layer")
    options = T.BlockOptions(num_heads=heads, keep_gathered_input=keep, config=config)
    layer = partial(T.transformer_block, axis_name=AXIS, options=options)
    fns[name] = ctx.smap(vjp_step(jax, layer), (P(AXIS), specs, P(AXIS)),
                         (P(AXIS), P(AXIS), specs))
    args[name] = (x, params, ct)
  return fns, args


def op_by_name(name: str) -> OpSpec:
  for spec in OPS.values():
    if name == spec.name or name in spec.aliases:
      return spec
  raise KeyError(f"unknown op {name!r}; ops: {sorted(OPS)}")


# ----------------------------------------------------------------------------
# Multi-process agreement (no-ops in one process)


class Agree:
  def __init__(self, jax):
    self.jax = jax
    self.n = jax.process_count()

  def max(self, values):
    if self.n == 1:
      return list(values)
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    arr = multihost_utils.process_allgather(np.asarray(values, dtype=np.float64))
    return [float(v) for v in np.max(np.asarray(arr).reshape(self.n, -1), axis=0)]

  def decide(self, flag: bool) -> bool:
    """Process 0's decision, on every process."""
    if self.n == 1:
      return flag
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    return bool(multihost_utils.broadcast_one_to_all(np.int32(1 if flag else 0)))


# ----------------------------------------------------------------------------
# One (op, shape): build, compile, check, time


HLO_OPCODES = ("all-gather-start", "all-gather", "reduce-scatter", "collective-permute-start",
               "collective-permute", "all-reduce-start", "all-reduce", "all-to-all",
               "async-start", "custom-call")
_OPCODE_RE = re.compile(r"\s(" + "|".join(re.escape(o) for o in HLO_OPCODES) + r")\(")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')


def hlo_counts(text: str) -> dict:
  """How many instructions of each collective opcode the optimised HLO has,
  and the custom-call targets (the project's FFI calls among them)."""
  counts = dict(collections.Counter(_OPCODE_RE.findall(text)))
  targets = collections.Counter(_TARGET_RE.findall(text))
  if targets:
    counts["custom_call_targets"] = dict(targets)
  return counts


def mib(nbytes):
  return None if nbytes is None else round(nbytes / 2**20, 2)


class Runner:
  def __init__(self, args, jax, mesh, budget: harness.Budget, result: dict):
    self.args, self.jax, self.mesh, self.budget, self.result = args, jax, mesh, budget, result
    self.agree = Agree(jax)
    self.ctx = Ctx(jax, mesh, args.seed)
    self.state = {"op": None, "shape": None, "phase": "start", "variant": None}
    self.watchdog = harness.Watchdog(args.hang_timeout, self.on_hang)
    self.first_shape = True
    self.main = jax.process_index() == 0
    self.banned = {}  # op -> {variant: why}, from hangs of an earlier attempt
    self.progress_file = progress_path(args.out) if self.main and args.out else None

  # -- bookkeeping
  def progress(self, phase, variant=None):
    self.state.update(phase=phase, variant=variant)
    self.watchdog.tick(f"{self.state['op']} {self.state['shape']} {phase} {variant or ''}")
    if self.progress_file:  # read by --resume after a kill that left no "hangs" entry
      try:
        with open(self.progress_file, "w") as f:
          json.dump(self.state, f)
      except OSError:
        pass

  def on_hang(self, what):
    hang = dict(self.state, what=what, at=time.time())
    self.result.setdefault("hangs", []).append(hang)
    self.result["finished"] = False
    self.save()

  def save(self):
    if self.main:
      self.result["elapsed_s"] = round(time.time() - self.budget.t0, 1)
      harness.write_json(self.args.out, self.result)

  def log(self, *a):
    if self.main:
      say(*a)

  # -- variants of an op
  def variants_for(self, spec: OpSpec) -> list[str]:
    a = self.args
    names = ([v for v in SMOKE_VARIANTS if v in spec.variants] if a.cpu_smoke
             else list(spec.variants))
    if a.peer == "windowed_einsum":
      names = ["windowed_einsum", "floor"]
    for item in a.extra_variants:  # OP=name,name
      opname, _, listed = item.partition("=")
      if op_by_name(opname).name == spec.name:
        names += [v for v in listed.split(",") if v and v not in names]
    if a.variants:
      pats = a.variants.split(",")
      names = [n for n in names if n == "floor" or any(fnmatch.fnmatch(n, p) for p in pats)]
    if "floor" not in names:
      names.append("floor")
    return names

  def shapes_for(self, spec: OpSpec):
    return runner_shapes(self.args, spec)

  # -- compile one case
  def compile_case(self, spec: OpSpec, shape, names):
    """Returns (compiled, args, entries) with errors recorded in entries."""
    entries = {n: {} for n in names}
    self.progress("build")
    fns, args = spec.build(self.ctx, shape, names)
    if not self.args.cpu_smoke:
      self.progress("autotune")
      choices = autotune_auto_variants(self.jax, self.ctx.jcg, self.mesh, fns, args, names)
      for n in names:
        if n.startswith("auto"):
          entries[n]["autotune"] = choices
    lowered = {}
    for n in names:
      if n in self.banned.get(spec.name, {}):
        entries[n]["error"] = self.banned[spec.name][n]
        continue
      self.progress("lower", n)
      try:
        if n == "auto_step" and not self.args.cpu_smoke:
          # The tuned step carries its decisions; `auto` keeps the per-op
          # choices of the process's plan.
          tuned = self.ctx.jcg.autotune_step(self.mesh, AXIS, fns[n], *args[n],
                                             seconds_per_problem=0.6)
          entries[n]["autotune_step"] = tuned.why
          lowered[n] = tuned.lower(*args[n])
        else:
          lowered[n] = fns[n].lower(*args[n])
      except Exception as e:  # noqa: BLE001  (a variant that fails is a result)
        entries[n]["error"] = "lower: " + short_error(e)

    def compile_one(n):
      t = time.time()
      c = lowered[n].compile()
      return c, time.time() - t

    compiled = {}
    threads = max(1, self.args.compile_threads)
    self.progress("compile")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      futures = {n: pool.submit(compile_one, n) for n in lowered}
      for n, fut in futures.items():
        try:
          compiled[n], entries[n]["compile_s"] = fut.result()
          entries[n]["compile_s"] = round(entries[n]["compile_s"], 2)
        except Exception as e:  # noqa: BLE001
          entries[n]["error"] = "compile: " + short_error(e)
    for n, c in compiled.items():
      try:
        ma = c.memory_analysis()
        for key, attr in (("temp_mib", "temp_size_in_bytes"), ("arg_mib", "argument_size_in_bytes"),
                          ("out_mib", "output_size_in_bytes")):
          entries[n][key] = mib(getattr(ma, attr, None))
      except Exception as e:  # noqa: BLE001
        entries[n]["memory_analysis_error"] = short_error(e, 120)
      try:
        entries[n]["hlo"] = hlo_counts(c.as_text())
      except Exception:  # noqa: BLE001
        pass
    return compiled, args, entries

  def drop_disagreeing(self, names, compiled, entries):
    """Every process runs the same variants (a collective alone would hang)."""
    bad = self.agree.max([0.0 if n in compiled else 1.0 for n in names])
    for n, b in zip(names, bad):
      if b and n in compiled:
        entries[n]["error"] = entries[n].get("error", "failed on another process")
        del compiled[n]

  # -- run one case
  def run_case(self, spec: OpSpec, shape, names):
    jax = self.jax
    t0 = time.time()
    rec = {"op": spec.name, "shape": list(shape), "shape_str": shape_str(shape),
           "floor_variant": "floor", "variants": {}}
    compiled, args, entries = self.compile_case(spec, shape, names)
    rec["variants"] = entries
    self.drop_disagreeing(names, compiled, entries)
    outs = {}
    for n in list(compiled):
      self.progress("first call", n)
      if os.environ.get("JCG_BENCH_DEBUG_HANG") == f"{spec.name}:{n}":
        time.sleep(1e6)  # tests the watchdog and --resume (run_all.sh retries once)
      try:
        out = compiled[n](*args[n])
        jax.block_until_ready(out)
        if n != "floor":
          outs[n] = out
      except Exception as e:  # noqa: BLE001
        entries[n]["error"] = "run: " + short_error(e)
        del compiled[n]
    self.drop_disagreeing(names, compiled, entries)
    # Numerics: every variant against the plain-JAX reference (or XLA).
    ref = next((r for r in ("pure_jax", "windowed_einsum", "xla") if r in outs), None)
    if ref:
      rec["rel_err_reference"] = ref
      jnp = jax.numpy

      def leaf_err(x, y):
        x, y = x.astype(jnp.float32).ravel(), y.astype(jnp.float32).ravel()
        return jnp.linalg.norm(x - y) / jnp.maximum(jnp.linalg.norm(y), 1e-30)

      relerr = jax.jit(lambda a, b: jnp.max(jnp.stack(
          [leaf_err(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])))
      for n, out in outs.items():
        self.progress("check", n)
        try:
          entries[n]["rel_err"] = float(f"{float(relerr(out, outs[ref])):.3g}")
        except Exception as e:  # noqa: BLE001
          entries[n]["rel_err_error"] = short_error(e, 160)
    outs.clear()
    if "floor" not in compiled:
      rec["error"] = "floor failed: " + str(entries.get("floor", {}).get("error"))
    warm = self.args.warmup_first_s if self.first_shape else self.args.warmup_s
    self.first_shape = False
    state = {}

    def on_warm():  # read while the timed rounds run
      if self.main:
        state["warm"] = harness.gpu_state_async()

    host = HostTimes(self.ctx.jcg.runtime.REGISTRY.call_counters)

    def tick(phase, variant=None):
      self.progress(phase, variant)
      if phase.startswith("round "):  # a timed batch of `variant` starts
        host.mark(variant)

    timings = harness.time_interleaved(
        compiled, args, floor="floor", rounds=self.args.rounds,
        target_ms=spec.target_ms * self.args.target_scale, warmup_s=warm,
        agree_max=self.agree.max, tick=tick, sync_each=self.args.cpu_smoke,
        max_iters=20 if self.args.cpu_smoke else 300,
        on_warm=on_warm) if compiled else {}
    host.mark(None)
    for n, t in timings.items():
      entries[n].update(t)
      entries[n].update(host.entry(n, batches=self.args.rounds, iters=t["iters"]))
    if self.main:
      rec["gpu_state_warm"] = state["warm"]() if "warm" in state else []
      rec["gpu_state_end"] = harness.gpu_state()
    rec["elapsed_s"] = round(time.time() - t0, 1)
    return rec

  # -- an op over its shapes, within its share of the budget
  def run_op(self, spec: OpSpec):
    share = self.budget.start(spec.name)
    names = self.variants_for(spec)
    shapes = self.shapes_for(spec)
    self.log(f"== {spec.name}: {len(shapes)} shapes x {len(names)} variants "
             f"({', '.join(names)}); budget {share:.0f} s")
    done = {(r["op"], tuple(r["shape"])) for r in self.result["records"] if "variants" in r}
    spent = []
    for shape in shapes:
      self.state.update(op=spec.name, shape=shape_str(shape))
      if (spec.name, tuple(shape)) in done:
        continue
      guess = (len(names) * (spec.compile_s / min(3, self.args.compile_threads) + 0.3)
               + self.args.warmup_s + self.args.rounds * len(names) * spec.target_ms
               * self.args.target_scale / 1e3 * 1.3)
      estimate = max(spent) if spent else guess
      if not self.agree.decide(self.budget.fits(estimate)):
        self.result["records"].append({"op": spec.name, "shape": list(shape),
                                       "shape_str": shape_str(shape),
                                       "skipped": f"budget (needs ~{estimate:.0f} s, "
                                                  f"{self.budget.part_left():.0f} s left)"})
        self.log(f"{spec.name} {shape_str(shape)}: skipped (budget)")
        self.save()
        continue
      t = time.time()
      try:
        rec = self.run_case(spec, shape, names)
      except NotImplementedError as e:
        rec = {"op": spec.name, "shape": list(shape), "shape_str": shape_str(shape),
               "skipped": str(e)}
      except Exception as e:  # noqa: BLE001  (one shape's failure is a result)
        rec = {"op": spec.name, "shape": list(shape), "shape_str": shape_str(shape),
               "error": short_error(e, 600)}
      spent.append(time.time() - t)
      self.result["records"].append(rec)
      self.save()
      self.log(line_for(rec))

  # -- profiles
  def run_profile(self, item: str):
    opname, shape_text, variant = item.split(":")
    spec = op_by_name(opname)
    shape = parse_shape(shape_text)
    self.state.update(op=spec.name, shape=shape_str(shape))
    jax = self.jax
    name = f"{spec.name}_{shape_str(shape)}_{variant}".replace("/", "_")
    folder = os.path.join(self.args.profile_dir, name + (
        f"_p{jax.process_index()}" if jax.process_count() > 1 else ""))
    entry = {"profile": item, "op": spec.name, "shape": list(shape), "variant": variant,
             "dir": folder}
    try:
      compiled, args, entries = self.compile_case(spec, shape, [variant])
      if variant not in compiled:
        raise RuntimeError(entries[variant].get("error", "did not compile"))
      f, a = compiled[variant], args[variant]
      jax.block_until_ready(f(*a))
      end = time.time() + self.args.profile_warmup_s
      while time.time() < end:  # the same steady state as the timings
        self.progress("profile warm-up", variant)
        for _ in range(5):
          out = f(*a)
          if self.args.cpu_smoke:
            jax.block_until_ready(out)
        jax.block_until_ready(out)
      self.progress("profile trace", variant)
      with jax.profiler.trace(folder, create_perfetto_trace=True):
        for i in range(self.args.profile_steps):
          with jax.profiler.TraceAnnotation(f"bench_step_{i}"):
            jax.block_until_ready(f(*a))
        # As the timings run: enqueued back to back, one wait at the end, so
        # that the gaps left are the GPU waiting (for a peer, a barrier, the
        # host's launches falling behind), not the wait after each step.
        with jax.profiler.TraceAnnotation("bench_back_to_back"):
          for _ in range(self.args.profile_steps):
            out = f(*a)
          jax.block_until_ready(out)
      traces = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"),
                                recursive=True), key=os.path.getmtime)
      if not traces:
        raise RuntimeError(f"no perfetto_trace.json.gz under {folder}")
      entry["trace"] = traces[-1]
      import trace_summary  # noqa: PLC0415
      mid = self.args.profile_steps // 2
      for key, window in (("step", f"bench_step_{mid}"), ("all_steps", "bench_step_"),
                          ("back_to_back", "bench_back_to_back")):
        lines = self.args.profile_timeline if key == "back_to_back" else 0
        summ = trace_summary.summarize(trace_summary.load(traces[-1]), window=window,
                                       include_host=self.args.cpu_smoke, timeline=lines)
        entry[key] = summ
        text = trace_summary.format_summary(summ, title=f"{item} [{key}: {window}]")
        if lines:  # which copy waited for which GEMM: the totals do not say
          text += "\n" + trace_summary.format_timeline(summ, lines)
        entry[key + "_text"] = text
        if self.main:
          print(text, flush=True)
          if self.args.profile_out:
            with open(self.args.profile_out, "a") as fh:
              fh.write(text + "\n\n")
    except Exception as e:  # noqa: BLE001
      entry["error"] = short_error(e, 600)
      self.log(f"profile {item}: FAILED {entry['error']}")
    # Keep the JSON small: the text has the detail.
    for key in ("step", "all_steps", "back_to_back"):
      if isinstance(entry.get(key), dict):
        entry[key] = {k: v for k, v in entry[key].items() if k != "events"}
    self.result.setdefault("profiles", []).append(entry)
    self.save()


def runner_shapes(a, spec: OpSpec):
  """The shapes of `spec` this run measures."""
  if a.shapes:
    wanted = [parse_shape(s) for s in a.shapes.split(",")]
    if a.any_shape:
      return wanted
    pool = set(spec.smoke if a.cpu_smoke else spec.shapes + spec.quick)
    return [s for s in wanted if s in pool]
  shapes = spec.smoke if a.cpu_smoke else (spec.quick if a.quick else spec.shapes)
  return list(shapes[: a.max_shapes] if a.max_shapes else shapes)


def progress_path(out: str) -> str:
  """Where the last step is noted (outside $OUT: only 8 files come back)."""
  tag = os.path.abspath(out).replace("/", "_").strip("_")
  return os.path.join("/tmp", f"jcg_bench_progress_{tag}.json")


class HostTimes:
  """The host time of each variant's fused calls in the timed rounds, from the
  contexts' counters (REGISTRY.call_counters) read as each batch starts: a
  batch's share is the difference to the next read (the one after the last
  batch is mark(None)). At small GEMMs the host sets the pace
  (docs/performance.md), so the records keep it."""

  def __init__(self, read: Callable):
    self.read = read
    self.last = None  # (variant, the counters at the start of its batch)
    self.sums: dict = {}  # variant: its batches' CallCounters

  def mark(self, variant: str | None) -> None:
    now = self.read()
    if self.last is not None:
      name, then = self.last
      span = now - then
      self.sums[name] = self.sums[name] + span if name in self.sums else span
    self.last = None if variant is None else (variant, now)

  def entry(self, variant: str, *, batches: int, iters: int) -> dict:
    """host_us_per_fused_call (on one GPU's context) and fused_calls_per_iter
    (per GPU), or nothing for a variant that made no fused call."""
    span = self.sums.get(variant)
    if span is None or span.calls <= 0:
      return {}
    return {"host_us_per_fused_call": round(span.host_us_per_call(), 1),
            "fused_calls_per_iter": round(span.calls / max(1, span.contexts)
                                          / (batches * iters), 2)}


def line_for(rec: dict) -> str:
  head = f"{rec['op']} {rec['shape_str']}: "
  if "variants" not in rec:
    return head + (rec.get("skipped") and "skipped: " + rec["skipped"] or "ERROR " + rec.get("error", "?"))
  parts = []
  for n, v in rec["variants"].items():
    if "median_ms" in v:
      of = v.get("over_floor")
      parts.append(f"{n} {v['median_ms']:.3f}" + (f" ({of:.3f})" if of is not None else ""))
    else:
      parts.append(f"{n} ERR[{str(v.get('error', '?'))[:80]}]")
  host = "  ".join(f"{n} {v['host_us_per_fused_call']:.0f}x{v['fused_calls_per_iter']:g}"
                   for n, v in rec["variants"].items() if "host_us_per_fused_call" in v)
  return (head + "median ms (over floor) " + "  ".join(parts)
          + f" | {harness.gpu_state_str(rec.get('gpu_state_warm') or rec.get('gpu_state_end', []))}"
          + (f" | host us a fused call x calls an iteration: {host}" if host else "")
          + f" | {rec.get('elapsed_s')} s")


# ----------------------------------------------------------------------------
# Memory: one fresh process per MLP variant


def autotune_auto_variants(jax, jcg, mesh, fns, args, names) -> dict:
  """What a user of backend="auto" does before training: list the problems the
  programs meet (jcg.backends.problems_of), autotune them (collective; choices cached on
  disk), then trace the programs, which take the choices. Returns {problem:
  [choice, why]} of every problem of these programs, those measured for an
  earlier shape too."""
  auto = [n for n in names if n.startswith("auto")]
  if not auto or not hasattr(jcg, "autotune"):
    return {}
  problems = list(dict.fromkeys(p for n in auto
                                for p in jcg.backends.problems_of(fns[n], *args[n])))
  jcg.backends.autotune(mesh, AXIS, problems, seconds_per_problem=0.6)
  plan = jcg.runtime.REGISTRY.plan()
  return {p.text(): list(plan.decision(p) or ("?", "not decided")) for p in problems}


def memory_worker(args):
  """Runs in its own process: the MLP step of one variant at each shape,
  ascending; prints one JSON line per shape."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
  connect_status(jax, mesh, args)
  spec = op_by_name(args.memory_op)
  ctx = Ctx(jax, mesh, args.seed)
  variant = args.memory_worker
  # Ascending by a rough size of the step's buffers (x, y, dx, ct; the weights
  # and their gradients; the hidden activations), so each shape's peak tops the last.
  shapes = sorted((parse_shape(s) for s in args.shapes.split(",")),
                  key=lambda s: 4 * s[0] * s[1] + 2 * s[1] * s[2] + 3 * s[0] * s[2] // 2)
  prev_peak = 0
  for shape in shapes:
    row = {"op": "mlp_step_memory", "of_op": spec.name, "shape": list(shape),
           "shape_str": shape_str(shape), "variant": variant}
    try:
      fns, fargs = spec.build(ctx, shape, [variant])
      import jax_comm_gemm as jcg  # noqa: PLC0415
      # The main process measured these problems first; here they come from its cache.
      autotune_auto_variants(jax, jcg, mesh, fns, fargs, [variant])
      c = fns[variant].lower(*fargs[variant]).compile()
      ma = c.memory_analysis()
      row["temp_mib"] = mib(getattr(ma, "temp_size_in_bytes", None))
      row["arg_mib"] = mib(getattr(ma, "argument_size_in_bytes", None))
      row["out_mib"] = mib(getattr(ma, "output_size_in_bytes", None))
      stats0 = [d.memory_stats() or {} for d in jax.local_devices()]
      out = c(*fargs[variant])
      jax.block_until_ready(out)
      del out
      stats = [d.memory_stats() or {} for d in jax.local_devices()]
      peaks = [s.get("peak_bytes_in_use") for s in stats if s.get("peak_bytes_in_use")]
      if peaks:
        peak = max(peaks)
        row["base_mib"] = mib(max(s.get("bytes_in_use", 0) for s in stats0))
        if peak > prev_peak:
          row["peak_mib"] = mib(peak)
        else:
          row["peak_mib"] = None
          row["note"] = (f"peak masked by an earlier shape in this process "
                         f"({mib(prev_peak)} MiB)")
        prev_peak = max(prev_peak, peak)
      else:
        row["peak_mib"] = None
        row["note"] = "no allocator statistics on this platform"
      del fargs, fns, c
    except Exception as e:  # noqa: BLE001
      row["error"] = short_error(e)
    print("MEMORY_RESULT " + json.dumps(row), flush=True)
  used = process_gpu_mib(os.getpid())
  print("MEMORY_PROC " + json.dumps({"variant": variant, "proc_gpu_mib": used}), flush=True)


def process_gpu_mib(pid):
  try:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=15).stdout
    return sum(float(line.split(",")[1]) for line in out.strip().splitlines()
               if line.split(",")[0].strip() == str(pid)) or None
  except Exception:  # noqa: BLE001
    return None


# Memory rows measured first, in this order: those the memory target compares,
# so that a budget that ends early still leaves pure_jax's and xla's peaks.
MEMORY_FIRST = ("auto", "pure_jax", "xla", "auto_step")


def memory_order(variants: list[str]) -> list[str]:
  """MEMORY_FIRST's variants first, then the others in their order."""
  return sorted(variants, key=lambda v: MEMORY_FIRST.index(v) if v in MEMORY_FIRST
                else len(MEMORY_FIRST))


def private_autotune_cache() -> str:
  """A copy of this process's autotune disk cache for the memory workers.

  They build `auto`'s programs from the choices measured here, but they run
  several at a time on the same GPUs: a problem not measured here (its cell
  skipped for budget) they measure under one another's load, and such times
  were once six times the true ones (pipelined_ce 2.98 ms against 0.43-0.47).
  Saved to the shared cache, they would steer every later benchmark process
  on that machine; the copy keeps them out of the cache that later processes
  read. The source is the cache this process's settings name."""
  import tempfile  # noqa: PLC0415
  import_jcg()
  from jax_comm_gemm.runtime.settings import Settings  # noqa: PLC0415
  source = Settings.from_environ().autotune_cache
  fd, copy = tempfile.mkstemp(prefix="jcg_memory_autotune_", suffix=".json")
  os.close(fd)
  if source and os.path.exists(source):
    shutil.copyfile(source, copy)
  else:
    os.remove(copy)  # the workers start with no cache, as this process did
  return copy


def run_memory(args, budget: harness.Budget, result: dict, save: Callable,
               tick: Callable = lambda *what: None):
  """Starts one worker process per MLP variant (a few at a time); `tick`
  tells the hang watchdog that the workers are being waited for."""
  share = budget.start("memory")
  spec = op_by_name("mlp_fwd_bwd")
  variants = [v for v in (SMOKE_VARIANTS if args.cpu_smoke else spec.variants)
              if not args.variants or v == "floor"
              or any(fnmatch.fnmatch(v, p) for p in args.variants.split(","))]
  variants = memory_order(variants)
  shapes = spec.smoke if args.cpu_smoke else (spec.quick if args.quick else spec.shapes)
  if args.memory_shapes:
    shapes = [parse_shape(s) for s in args.memory_shapes.split(",")]
  say(f"== mlp_step_memory: {len(variants)} variants x {len(shapes)} shapes, "
      f"{args.memory_jobs} at a time; budget {share:.0f} s")
  cache = private_autotune_cache()
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             JAX_COMM_GEMM_AUTOTUNE_CACHE=cache)
  for item in args.memory_env:
    key, _, value = item.partition("=")
    env[key] = value
  base = [sys.executable, os.path.abspath(__file__), "--memory-op", spec.name,
          "--shapes", ",".join(shape_str(s) for s in shapes), "--seed", str(args.seed)]
  if args.cpu_smoke:
    base.append("--cpu-smoke")
  pending, running, rows = list(variants), [], []
  deadline = time.time() + max(share, 20.0)
  while pending or running:
    while pending and len(running) < max(1, args.memory_jobs) and time.time() < deadline - 15:
      v = pending.pop(0)
      p = subprocess.Popen(base + ["--memory-worker", v], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
      running.append((v, p))
    if not running:
      break
    time.sleep(0.5)
    tick("memory workers")
    for v, p in list(running):
      if p.poll() is None and time.time() > deadline:
        p.kill()
      if p.poll() is not None:
        running.remove((v, p))
        text = p.stdout.read()
        got = [json.loads(line[len("MEMORY_RESULT "):]) for line in text.splitlines()
               if line.startswith("MEMORY_RESULT ")]
        proc = [json.loads(line[len("MEMORY_PROC "):]) for line in text.splitlines()
                if line.startswith("MEMORY_PROC ")]
        for row in got:
          if proc:
            row["proc_gpu_mib"] = proc[0].get("proc_gpu_mib")
        if not got:
          tail = " ".join(line for line in text.splitlines()[-6:])[-400:]
          got = [{"op": "mlp_step_memory", "shape": list(s), "shape_str": shape_str(s),
                  "variant": v, "error": f"worker rc={p.returncode}: {tail}"} for s in shapes]
        rows += got
        for row in got:
          say(f"mlp_step_memory {row['shape_str']} {v}: temp {row.get('temp_mib')} MiB, "
              f"peak {row.get('peak_mib')} MiB" + (f" ERROR {row['error'][:200]}"
                                                    if "error" in row else ""))
        result["memory"] = rows
        save()
  for v in pending:
    rows += [{"op": "mlp_step_memory", "shape": list(s), "shape_str": shape_str(s),
              "variant": v, "skipped": "budget"} for s in shapes]
  result["memory"] = rows
  save()
  if os.path.exists(cache):
    os.remove(cache)


# ----------------------------------------------------------------------------
# Set-up


def connect_status(jax, mesh, args) -> dict:
  """jcg.connect once per process before any cuBLASMp program (collective)."""
  if args.peer or args.no_connect:
    return {"called": False}
  status: dict[str, Any] = {"called": True}
  try:
    jcg = import_jcg()
    status["jax_comm_gemm"] = getattr(jcg, "__version__", "?")
    status["jax_comm_gemm_file"] = getattr(jcg, "__file__", "?")
    t = time.time()
    connect = jcg.connect  # the public API; its absence is a finding, not a crash
    res = connect(mesh, axis_name=AXIS)
    status["ok"] = True
    status["seconds"] = round(time.time() - t, 2)
    if res is not None:
      status["result"] = str(res)[:400]
  except Exception as e:  # noqa: BLE001
    status["ok"] = False
    status["error"] = short_error(e)
  try:
    jcg = import_jcg()
    for fn in ("cublasmp_status", "cublasmp_version"):
      if hasattr(jcg, fn):
        status[fn] = str(getattr(jcg, fn)())[:300]
  except Exception as e:  # noqa: BLE001
    status["import_error"] = short_error(e)
  return status


def spawn(args, argv) -> int:
  """One child per GPU, jax.distributed over 127.0.0.1."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  rest, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a == "--spawn":
      skip = True
      continue
    if a.startswith("--spawn="):
      continue
    rest.append(a)
  procs = []
  for i in range(args.spawn):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i))
    cmd = [sys.executable, os.path.abspath(__file__), *rest, "--coordinator",
           f"127.0.0.1:{port}", "--num-processes", str(args.spawn), "--process-id", str(i)]
    procs.append(subprocess.Popen(cmd, env=env))
  rcs = []
  for p in procs:
    try:
      rcs.append(p.wait(timeout=args.budget + 30))
    except subprocess.TimeoutExpired:
      p.kill()
      rcs.append(124)
  say(f"spawned processes exited with {rcs}")
  return max(rcs)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="JSON written after every shape")
  p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
  p.add_argument("--quick", action="store_true", help="fewer shapes, rounds and warm-up")
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, xla/pure_jax/floor, CPU")
  p.add_argument("--ops", default="all_gather_matmul,all_gather_matmul_sweep,matmul_reduce_scatter,"
                 "row_parallel_fwd_bwd,mlp_fwd_bwd,memory",
                 help="comma list of ops (or aliases ag,sweep,rs,row,mlp), 'memory', or 'none'")
  p.add_argument("--transformer", action="store_true", help="add the transformer block")
  p.add_argument("--variants", help="glob filter of variant names (floor always runs)")
  p.add_argument("--extra-variants", action="append", default=[],
                 help="OP=name,name: add variants to an op (repeatable)")
  p.add_argument("--shapes", help="only these shapes (n x k x m), comma separated")
  p.add_argument("--any-shape", action="store_true", help="with --shapes: allow unlisted shapes")
  p.add_argument("--max-shapes", type=int, default=0)
  p.add_argument("--rounds", type=int)
  p.add_argument("--target-scale", type=float, default=1.0, help="scales each round's ms per variant")
  p.add_argument("--warmup-s", type=float, help="load before each shape's rounds")
  p.add_argument("--warmup-first-s", type=float, help="load before the first shape's rounds")
  p.add_argument("--compile-threads", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--hang-timeout", type=float, default=120.0, help="0: no watchdog")
  p.add_argument("--resume", action="store_true", help="keep --out's finished shapes; skip "
                 "variants that hung")
  p.add_argument("--peer", choices=["windowed_einsum"], help="run a peer instead of the project")
  p.add_argument("--no-connect", action="store_true", help="do not call jcg.connect")
  p.add_argument("--part-name", help="the 'part' field of the JSON")
  # memory
  p.add_argument("--memory-jobs", type=int, default=5, help="memory workers at a time")
  p.add_argument("--memory-shapes", help="MLP shapes for the memory rows")
  p.add_argument("--memory-env", action="append", default=[],
                 help="KEY=VALUE for the memory workers (e.g. to turn autotuning off)")
  p.add_argument("--memory-worker", help=argparse.SUPPRESS)
  p.add_argument("--memory-op", default="mlp_fwd_bwd", help=argparse.SUPPRESS)
  # profiles
  p.add_argument("--profile", action="append", default=[], help="OP:SHAPE:VARIANT (repeatable)")
  p.add_argument("--profile-dir", default="/tmp/jcg_profiles")
  p.add_argument("--profile-steps", type=int, default=5)
  p.add_argument("--profile-warmup-s", type=float, default=2.0)
  p.add_argument("--profile-out", help="append the trace summaries to this text file")
  p.add_argument("--profile-timeline", type=int, default=30, metavar="N",
                 help="list each device's first N pieces of work of the back-to-back window")
  # processes
  p.add_argument("--spawn", type=int, default=0, help="run N processes, one per GPU")
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  a = p.parse_args(argv)
  quick = a.quick or a.cpu_smoke
  a.rounds = a.rounds or (3 if a.cpu_smoke else 6 if a.quick else 8)
  a.warmup_s = a.warmup_s if a.warmup_s is not None else (0.2 if a.cpu_smoke else 1.5 if quick else 2.0)
  a.warmup_first_s = a.warmup_first_s if a.warmup_first_s is not None else (
      0.5 if a.cpu_smoke else 4.0 if quick else 6.0)
  if a.cpu_smoke:
    a.target_scale = min(a.target_scale, 0.25)
  return a


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.cpu_smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                 + " --xla_force_host_platform_device_count=2").strip()
  if args.peer == "windowed_einsum" and WINDOWED_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + WINDOWED_FLAG).strip()
  if "memory" in args.ops.split(",") and not args.memory_worker:
    # The memory workers run beside this process: leave them room on the GPUs.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  if args.spawn:
    return spawn(args, argv)
  if args.memory_worker:
    return memory_worker(args)

  t_start = time.time()
  import jax  # noqa: PLC0415
  if args.coordinator:
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  import jaxlib  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
  main_proc = jax.process_index() == 0
  part = args.part_name or (args.peer or "project")
  result: dict[str, Any] = {
      "part": part, "schema": 1, "argv": sys.argv, "finished": False,
      "machine": harness.machine_facts() if main_proc else {},
      "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "numpy": np.__version__},
      "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
      "method": {"rounds": args.rounds, "warmup_s": args.warmup_s,
                 "warmup_first_s": args.warmup_first_s, "target_scale": args.target_scale,
                 "quick": args.quick, "cpu_smoke": args.cpu_smoke, "budget_s": args.budget,
                 "xla_flags": os.environ.get("XLA_FLAGS", "")},
      "records": [], "memory": [], "profiles": [], "attempts": 1,
  }
  if args.resume and args.out and os.path.exists(args.out):
    try:
      with open(args.out) as f:
        old = json.load(f)
      result["records"] = [r for r in old.get("records", []) if "variants" in r]
      result["memory"] = old.get("memory", [])
      result["profiles"] = old.get("profiles", [])
      result["hangs"] = old.get("hangs", [])
      result["attempts"] = old.get("attempts", 1) + 1
      last = progress_path(args.out)
      if os.path.exists(last) and not old.get("finished"):
        with open(last) as f:
          state = json.load(f)
        known = {(h.get("op"), h.get("shape"), h.get("variant")) for h in result["hangs"]}
        if (state.get("op"), state.get("shape"), state.get("variant")) not in known:
          result["hangs"].append(dict(state, what="killed (no watchdog entry)"))
      if any(h.get("phase") == "compile" for h in result["hangs"]):
        args.compile_threads = 1
    except Exception as e:  # noqa: BLE001
      say(f"resume: could not read {args.out}: {short_error(e)}")
  ops = [o for o in args.ops.split(",") if o and o != "none"]
  if args.transformer and "transformer_fwd_bwd" not in ops:
    ops.insert(ops.index("memory") if "memory" in ops else len(ops), "transformer_fwd_bwd")
  if args.peer or jax.process_count() > 1:
    ops = [o for o in ops if o != "memory"]  # memory rows: the project, one process
  done_profiles = {p.get("profile") for p in result["profiles"]}
  args.profile = [p for p in args.profile if p not in done_profiles]  # after --resume
  if result["memory"]:
    ops = [o for o in ops if o != "memory"]  # after --resume
  done = {(r["op"], tuple(r["shape"])) for r in result["records"]}
  specs = [op_by_name(o) for o in ops if o != "memory"]
  weights = {s.name: s.weight * max(0.1, sum((s.name, tuple(x)) not in done for x in
                                             runner_shapes(args, s)) / max(1, len(runner_shapes(args, s))))
             for s in specs}
  if args.profile:
    weights["profile"] = 4.0 * len(args.profile)
  if "memory" in ops:
    weights["memory"] = 16.0
  budget = harness.Budget(args.budget - (time.time() - t_start), weights)
  runner = Runner(args, jax, mesh, budget, result)
  for h in result.get("hangs", []):
    if h.get("variant"):
      runner.banned.setdefault(h["op"], {})[h["variant"]] = f"hung in an earlier attempt ({h.get('phase')})"
  runner.progress("connect")
  result["connect"] = connect_status(jax, mesh, args)
  if main_proc:
    say(json.dumps({k: result[k] for k in ("part", "versions", "devices", "connect")}))
    if result["connect"].get("called") and not result["connect"].get("ok"):
      say("WARNING: jcg.connect failed or is missing: 'auto' may run XLA, and the "
          "cuBLASMp variants will fail: " + str(result["connect"].get("error")))
  runner.save()
  for spec in specs:
    runner.run_op(spec)
  if specs:
    add_sweep_copies(result)
  if args.profile:
    budget.start("profile")
    for item in args.profile:
      runner.run_profile(item)
  # The memory rows before the retry of skipped shapes: they are part of every
  # run's result, while the retry only uses what is left (run after the retry,
  # the memory part once had 13 s left and measured 5 of 36 rows).
  if "memory" in ops and main_proc:
    run_memory(args, budget, result, runner.save, tick=runner.progress)
  if specs:
    retry_budget_skips(result, specs, runner.run_op)
    add_sweep_copies(result)
  runner.watchdog.stop()
  result["finished"] = True
  runner.save()
  if runner.progress_file and os.path.exists(runner.progress_file):
    os.remove(runner.progress_file)
  if main_proc:
    print_brief(result)
  return 0


def add_sweep_copies(result):
  """The sweep's points at k = m = 8192 that the main AG list measured."""
  have = {tuple(r["shape"]) for r in result["records"] if r["op"] == "all_gather_matmul_sweep"}
  for r in list(result["records"]):
    if (r["op"] == "all_gather_matmul" and "variants" in r and r["shape"][1:] == [8192, 8192]
        and tuple(r["shape"]) not in have):
      copy = json.loads(json.dumps(r))
      copy["op"] = "all_gather_matmul_sweep"
      copy["copied_from"] = "all_gather_matmul"
      result["records"].append(copy)


def retry_budget_skips(result: dict, specs, run_op: Callable) -> None:
  """Runs again, with the time left, the shapes that each op skipped for its
  share of the budget: the parts after it (the profiles, the memory rows) may
  use less than their shares, and a run once lost 9 cells so while 98 s of its
  budget went unused. The measured record replaces the "skipped" one; a shape
  that still does not fit is skipped again."""
  for spec in specs:
    skipped = [r for r in result["records"]
               if r["op"] == spec.name and str(r.get("skipped", "")).startswith("budget")]
    if skipped:
      result["records"] = [r for r in result["records"] if all(r is not s for s in skipped)]
      run_op(spec)


def print_brief(result):
  say("==== brief (over floor; best non-floor variant per shape)")
  for r in result["records"]:
    if "variants" not in r or r.get("copied_from"):
      if "variants" not in r:
        say(line_for(r))
      continue
    vs = {n: v.get("over_floor") for n, v in r["variants"].items()
          if v.get("over_floor") is not None and n != "floor"}
    best = min(vs, key=vs.get) if vs else None
    key = " ".join(f"{n} {vs[n]:.3f}" for n in ("auto", "xla", "pure_jax", "windowed_einsum")
                   if n in vs)
    floor = r["variants"].get("floor", {}).get("median_ms")
    say(f"{r['op']} {r['shape_str']}: best {best} {vs.get(best, float('nan')):.3f} | {key}"
        + (f" | floor {floor:.3f} ms" if floor else ""))
  for m in result.get("memory", []):
    if "temp_mib" in m or "error" in m:
      say(f"mlp_step_memory {m['shape_str']} {m['variant']}: temp {m.get('temp_mib')} "
          f"peak {m.get('peak_mib')}" + (" ERROR" if "error" in m else ""))


if __name__ == "__main__":
  sys.exit(main())
