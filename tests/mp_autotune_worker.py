"""One of the two CPU processes of test_multiprocess.py's autotune test.

Usage: ``python mp_autotune_worker.py PROCESS_ID PORT PLANTS`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and ``JAX_PLATFORMS=cpu``.
PLANTS is a comma-separated list of ``phase=implementation`` with phase
"build", "check" or "time": in process 1 alone, that implementation fails to
build (its op raises while traced), returns a wrong result (process 1's shards
of its output times 2), or raises in its second timed batch (after its program
ran, as an error reported late would). Process 0 runs everything as it is.

The wrong result is made after the candidate's program ran, not inside it: the
processes of one collective must run the same program (jax 0.12's CPU
collectives wait forever for a peer whose program differs; docs/design.md,
"Agreement between processes"), and a real candidate's wrong result comes from
the same program in every process.

Both processes join through ``jax.distributed`` and run ``autotune_step`` on
a sequence-parallel MLP's gradient over a tensor-parallel axis of all 4
devices, spanning both processes: first the per-op autotune of each problem
the step meets, then the step under each plan, every candidate a real
collective program (on CPU the fused ops lower to XLA's collectives, with a
plan as if cuBLASMp ran). Prints one JSON line:
``{"process": i, "ok": bool, "choices": {problem: [choice, why]},
"step": [plan, why], "error": str}``.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_comm_gemm as jcg  # noqa: E402
import jax_comm_gemm.runtime.plan as plan_lib  # noqa: E402
from jax_comm_gemm.backends import routes, tuning  # noqa: E402
from jax_comm_gemm.runtime import REGISTRY, comm_id  # noqa: E402
from jax_comm_gemm.runtime.capability import Capability  # noqa: E402
from mp_worker import run_and_report  # noqa: E402
from jax_comm_gemm.runtime.settings import Settings  # noqa: E402


class _Versions:
  """What autotune asks of the C++ extension (its cache section's versions)."""

  def cublasmp_version(self):
    return 1000

  def nccl_version(self):
    return 23203


class _Refuses:
  """A backend whose ops raise while traced: the candidate fails to build."""

  def __init__(self, name):
    self.name = name

  def __getattr__(self, attr):
    def refuse(*args, **kwargs):
      raise RuntimeError(f"planted: {self.name} cannot be built here")
    return refuse


def _plant(plants: dict[str, str]) -> None:
  """Makes process 1's candidates fail as `plants` ({phase: implementation}) says."""
  if jax.process_index() != 1:
    return
  real_implementation = routes.implementation

  def implementation(name, template):
    backend = real_implementation(name, template)
    return _Refuses(name) if name == plants.get("build") else backend

  # autotune builds its candidates through tuning's name, the step's layers
  # through auto's; each op's candidates and each step plan run through
  # time_candidates, under the implementation's name.
  tuning.implementation = routes.implementation = implementation
  real_time_candidates = tuning.time_candidates

  def time_candidates(runs, **kwargs):
    """time_candidates, the "check" plant's calls doubled and the "time" plant's
    failing late."""
    check, late = plants.get("check"), plants.get("time")
    if isinstance(runs.get(check), tuple):
      call, iterations = runs[check]
      runs = {**runs, check: (lambda call=call: _doubled(call()), iterations)}
    if isinstance(runs.get(late), tuple):
      call, iterations = runs[late]
      good_calls = 1 + (kwargs["warmup_rounds"] + 1) * iterations
      runs = {**runs, late: (_fails_late(call, good_calls, late), iterations)}
    return real_time_candidates(runs, **kwargs)

  tuning.time_candidates = time_candidates


def _doubled(out):
  """`out` with each of this process's shards times 2 (no collective: the
  other process does not run it)."""
  def double(a):
    return jax.make_array_from_single_device_arrays(
        a.shape, a.sharding, [2 * s.data for s in a.addressable_shards])
  return jax.tree.map(double, out)


def _fails_late(call, good_calls: int, name: str):
  """`call`, raising after its program ran on each call after the first
  `good_calls` (the warm-up call and the warm-up rounds' batches)."""
  calls = [0]

  def fails_late():
    out = call()
    calls[0] += 1
    if calls[0] > good_calls:
      raise RuntimeError(f"planted: {name} failed while timed")
    return out
  return fails_late


def run(process_id: int, plants: dict[str, str]) -> dict:
  assert jax.process_count() == 2 and jax.device_count() == 4
  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  # A plan as connect publishes it where cuBLASMp runs: the axis connected,
  # measuring on, no disk cache (every choice is measured here).
  REGISTRY._status, REGISTRY._native = Capability(True, "stand-in"), _Versions()
  REGISTRY.publish(plan_lib.Plan(Settings(autotune_cache="", connect_timeout_s=60.0),
                                 Capability(True, "stand-in"), "tail")
                   .with_axis(mesh, "tp", comm_id(mesh, "tp"), {}))
  _plant(plants)
  choices = {}
  real_measure = tuning.measure

  def measure(*args, **kwargs):
    found = real_measure(*args, **kwargs)
    choices.update({p.text(): list(choice) for p, choice in found.items()})
    return found

  tuning.measure = measure
  x, w1, w2 = (jax.random.normal(jax.random.key(i), s, jnp.float32)
               for i, s in enumerate([(32, 16), (16, 64), (64, 16)]))

  def step(x, w1, w2):
    local = jax.shard_map(lambda x, a, b: jcg.mlp(x, a, b, axis_name="tp"), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    return jax.grad(lambda a, b: jnp.sum(local(x, a, b) ** 2), (0, 1))(w1, w2)

  tuned = jcg.autotune_step(mesh, "tp", step, x, w1, w2, iterations=1, rounds=3,
                            seconds_per_problem=1e-6)
  jax.block_until_ready(tuned(x, w1, w2))  # the plan taken runs, in both processes
  return {"choices": choices, "step": [tuned.plan, tuned.why]}


def main() -> int:
  process_id, port = int(sys.argv[1]), int(sys.argv[2])
  plants = dict(item.split("=") for item in sys.argv[3].split(",") if item)
  return run_and_report(process_id, port, lambda: run(process_id, plants))


if __name__ == "__main__":
  sys.exit(main())
