"""The stress check (issue 8): many MLP forward+backward runs on the cuBLASMp
backend, each on fresh random inputs and checked per row against a
high-precision reference. A race between a fused call and the XLA work around
it, or a peer's next call, shows up as an occasional wrong run, not as an
error: the one ordering the extension uses (docs/design.md#ordering-against-xla-the-fence)
must give none.

Three programs are compiled once, at n x d x f = 1024 x 512 x 1024 in bf16:
the inputs (from a run index), the fused step (one per variant: plain,
keep_gathered_input, no reuse of the gathered operand, cuBLASMp's split_p2p
GEMM+ReduceScatter, the project's own
pipelined and pipelined_ce AllGather+GEMMs, whose cross-call safety rests on
NCCL ordering their transfers, and pipelined_ce for both ops) and the check
(a float32 reference at HIGHEST precision
through XLA's own collectives, then checks.rel_err's per-row measure: max
|error| in a row of a shard's block over max |reference| in that row, worst
row over all shards). Runs are dispatched in chunks without waiting, so the
GPU runs them back to back as a training loop would; the errors are fetched
once per chunk. Every CROSS_EVERY-th run, and every run found wrong (up to
MAX_HOST_CHECKS), is checked again on the host against checks.mlp_reference
in float64, to make sure the GPU reference is not what is wrong.

Run alone: ``python tests/gpu/stress.py [--runs N] [--process-id I
--num-processes N --port P]`` (failures.py's set-up and result line).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import checks  # noqa: E402

VARIANTS = {"plain": {}, "keep_input": {"keep": True}, "no_reuse": {"reuse_gathered": False},
            "rs_split_p2p": {"reduce_scatter": "split_p2p"},
            "pipelined_ce": {"all_gather_algorithm": "pipelined_ce"},
            "own_ce": {"all_gather_algorithm": "pipelined_ce", "reduce_scatter": "pipelined_ce"}}
IN_SPECS, OUT_SPECS = checks.MLP_IN_SPECS, checks.MLP_OUT_SPECS
OUTPUTS = ("y", "dx", "dw1", "dw2")
CHUNK = int(os.environ.get("JCG_STRESS_CHUNK", "20"))  # runs in flight before a fetch
CROSS_EVERY = 50
MAX_HOST_CHECKS = 30


def row_error(out, ref):
  """checks.rel_err on one shard's block: the worst row's max |error| over its
  max |reference| (NaN counts as infinitely wrong)."""
  out = out.astype(jnp.float32)
  err = jnp.max(jnp.abs(out - ref), axis=-1) / jnp.maximum(jnp.max(jnp.abs(ref), axis=-1), 1e-30)
  worst = jnp.max(err)
  return jnp.where(jnp.isnan(worst), jnp.inf, worst)


def reference_errors(mesh):
  """(x, w1, w2, g, y, dx, dw1, dw2) -> the per-row error of each output, [4],
  the same on every device: a float32 reference at HIGHEST precision with
  XLA's collectives, compared shard by shard."""
  hi = lax.Precision.HIGHEST

  def check(x, w1, w2, g, y, dx, dw1, dw2):
    x, w1, w2, g = (a.astype(jnp.float32) for a in (x, w1, w2, g))
    xg = lax.all_gather(x, "tp", tiled=True)
    gg = lax.all_gather(g, "tp", tiled=True)
    h = jnp.matmul(xg, w1, precision=hi)
    a, gelu_vjp = jax.vjp(jax.nn.gelu, h)
    y_ref = lax.psum_scatter(jnp.matmul(a, w2, precision=hi), "tp", tiled=True)
    (dh,) = gelu_vjp(jnp.matmul(gg, w2.T, precision=hi))
    dx_ref = lax.psum_scatter(jnp.matmul(dh, w1.T, precision=hi), "tp", tiled=True)
    dw1_ref = jnp.matmul(xg.T, dh, precision=hi)
    dw2_ref = jnp.matmul(a.T, gg, precision=hi)
    errs = jnp.stack([row_error(o, r) for o, r in
                      zip((y, dx, dw1, dw2), (y_ref, dx_ref, dw1_ref, dw2_ref))])
    return lax.pmax(errs, "tp")

  return checks.smap(mesh, check, IN_SPECS + OUT_SPECS, P())


def input_maker(mesh, n: int, d: int, f: int, seed: int, dtype=jnp.bfloat16):
  """run index (a replicated uint32 array) -> fresh (x, w1, w2, g), each
  distributed like checks.check_mlp's."""
  shardings = tuple(NamedSharding(mesh, s) for s in IN_SPECS)

  def make(i):
    keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), i), 4)
    shapes = ((n, d, 1.0), (d, f, d**-0.5), (f, d, f**-0.5), (n, d, 1.0))
    return tuple((jax.random.normal(k, s[:2], jnp.float32) * s[2]).astype(dtype)
                 for k, s in zip(keys, shapes))

  make = jax.jit(make, out_shardings=shardings)
  index_sharding = NamedSharding(mesh, P())

  def inputs(i: int):
    index = jax.make_array_from_callback((), index_sharding,
                                         lambda _: np.asarray(i, np.uint32))
    return make(index)

  return inputs


def host_check(replicate, inputs, outs, tol: float) -> dict:
  """The float64 check of checks.check_mlp for one run."""
  full = [np.asarray(a.addressable_data(0), np.float64) for a in replicate(*inputs)]
  refs = checks.mlp_reference(*full)
  errs = {name: checks.rel_err(o, r) for name, o, r in zip(OUTPUTS, outs, refs)}
  return {"errs": {k: float(f"{v:.3g}") for k, v in errs.items()},
          "ok": all(v < tol for v in errs.values())}


def run_stress(mesh, runs: int = 500, *, n: int = 1024, d: int = 512, f: int = 1024,
               seed: int | None = None, variants=None, backend: str = "cublasmp",
               dtype: str = "bf16") -> dict:
  """`runs` MLP forward+backward runs, variants in turn; returns counts and
  the wrong runs (`ok` is whether none was wrong)."""
  if variants is None and os.environ.get("JCG_STRESS_VARIANTS"):  # e.g. cuBLASMp's only
    variants = {name: VARIANTS[name] for name in os.environ["JCG_STRESS_VARIANTS"].split(",")}
  variants = dict(variants or VARIANTS)
  seed = int(os.environ.get("JCG_STRESS_SEED", "0")) if seed is None else seed
  tol = checks.TOLERANCE[dtype] * 2  # check_mlp's bound
  start = time.perf_counter()
  inputs_for = input_maker(mesh, n, d, f, seed, checks.DTYPES[dtype])
  steps = {name: checks.mlp_step(mesh, backend=backend, **checks.own_where_refused(mesh, **kw))
           for name, kw in variants.items()}
  check = reference_errors(mesh)
  replicate = jax.jit(lambda *a: a, out_shardings=NamedSharding(mesh, P()))
  first = inputs_for(0)
  compiled = {name: s.lower(*first).compile() for name, s in steps.items()}
  check = check.lower(*first, *compiled[next(iter(compiled))](*first)).compile()
  # Each program once, waited for: set-up (communicators, plans, workspace)
  # happens here, not with a chunk of runs in flight.
  for name in compiled:
    jax.block_until_ready(check(*first, *compiled[name](*first)))
  compile_s = time.perf_counter() - start

  names = list(variants)
  per_variant = {name: {"runs": 0, "wrong": 0} for name in names}
  worst_ok = {o: 0.0 for o in OUTPUTS}
  wrong, host_checks, disagreements = [], [], []
  pending = []

  def drain():
    errs = np.stack([np.asarray(e.addressable_data(0)) for *_, e in pending])
    for (i, name, ins, outs, _), row in zip(pending, errs):
      per_variant[name]["runs"] += 1
      bad = not bool(np.all(row < tol))
      entry = {"run": i, "variant": name,
               "errs": {o: float(f"{v:.3g}") for o, v in zip(OUTPUTS, row)}}
      if bad:
        per_variant[name]["wrong"] += 1
        wrong.append(entry)
      else:
        for o, v in zip(OUTPUTS, row):
          worst_ok[o] = max(worst_ok[o], float(v))
      # Every process takes the same decisions (the errors are the same on
      # every device), so the collective `replicate` runs in step.
      if (bad or i % CROSS_EVERY == 0) and len(host_checks) < MAX_HOST_CHECKS:
        host = host_check(replicate, ins, outs, tol)
        host_checks.append({**entry, "host": host})
        if host["ok"] == bad:
          disagreements.append({**entry, "host": host})
    pending.clear()

  run_start = time.perf_counter()
  for i in range(runs):
    name = names[i % len(names)]
    ins = first if i == 0 else inputs_for(i)
    outs = compiled[name](*ins)
    pending.append((i, name, ins, outs, check(*ins, *outs)))
    if len(pending) == CHUNK:
      drain()
  if pending:
    drain()
  run_s = time.perf_counter() - run_start
  return {
      "ok": not wrong and not disagreements,
      "runs": runs,
      "wrong": len(wrong),
      "rate": len(wrong) / max(runs, 1),
      "tolerance": tol,
      "shape": {"n": n, "d": d, "f": f, "dtype": dtype},
      "per_variant": per_variant,
      "worst_error_of_right_runs": worst_ok,
      "wrong_runs": wrong[:20],
      "host_checks": len(host_checks),
      "host_checks_wrong": sum(not h["host"]["ok"] for h in host_checks),
      "host_disagreements": disagreements[:10],
      "compile_seconds": round(compile_s, 2),
      "run_seconds": round(run_s, 2),
      "ms_per_run": round(1000 * run_s / max(runs, 1), 2),
  }


if __name__ == "__main__":
  import failures  # noqa: E402

  failures.main(["--scenarios", "stress", *sys.argv[1:]])
