"""One of the two CPU processes of test_multiprocess.py.

Usage: ``python mp_worker.py PROCESS_ID PORT [disagree]`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and ``JAX_PLATFORMS=cpu``.
Joins the other process through ``jax.distributed``, runs the sharded layers
forward and backward over all 4 devices, checks this process's shards against
a float64 reference computed locally from the same seeds, then runs
``jax_comm_gemm.connect`` with a stand-in for the C++ extension (the real
key-value store carries the fingerprints and the NCCL-id stand-in), lowers a
cuBLASMp program for the GPU in process 0 alone, and sees a disagreement
raised in both processes. With ``disagree`` it only calls ``connect`` on a
CPU mesh, its JAX_COMM_GEMM_BACKEND set unlike the other process's. Prints
one JSON line:
``{"process": i, "ok": bool, "checks": [...], "unique_id": hex, "error": str}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fused_emulation import (ROUTINGS, TOLERANCE, random_inputs,  # noqa: E402
                             reference_value_and_grad, relative_error)
import jax_comm_gemm as jcg  # noqa: E402
import jax_comm_gemm.runtime.communicators as communicators  # noqa: E402
from jax_comm_gemm import sharded  # noqa: E402
from jax_comm_gemm.runtime import REGISTRY, agreement, capability  # noqa: E402
from jax_comm_gemm.runtime.capability import Capability  # noqa: E402

N, S, K, F = 16, 2, 16, 32


def _global(mesh, value, spec):
  """A global array with `spec`, built from the same full value in every process."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                      lambda index: value[index])


def _check(name, fn, reference, mesh, values, specs, seed, checks):
  """jit(value_and_grad) of sum(fn(...) * cotangent) on global arrays; every
  addressable shard of the output and of each gradient against the reference."""
  (cotangent,) = random_inputs(seed + 1, [jax.eval_shape(reference, *values)[0].shape],
                               jnp.float32)
  args = [_global(mesh, v, s) for v, s in zip(values, specs)]

  def loss(*args):
    out = fn(*args)
    return jnp.sum(out * cotangent), out

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                       has_aux=True))
  (_, out), grads = grad_fn(*args)
  ref_outs, ref_grads = reference_value_and_grad(reference, values, [cotangent])
  tol = TOLERANCE[jnp.dtype(jnp.float32)]
  for what, actual, expected in [("out", out, ref_outs[0])] + [
      (f"grad{i}", g, r) for i, g, r in zip(range(len(grads)), grads, ref_grads)]:
    assert actual.shape == expected.shape, (name, what, actual.shape, expected.shape)
    shards = actual.addressable_shards
    assert shards, (name, what, "no addressable shards")
    for shard in shards:
      err = relative_error(shard.data, expected[shard.index])
      assert err <= tol, f"{name} {what} shard {shard.index}: relative error {err:.3g}"
    checks.append(f"{name}:{what}:{len(shards)} shards")


def _mlp_reference(x, fc1, fc2, b1, b2):
  return (jax.nn.gelu(x @ fc1 + b1) @ fc2 + b2,)


def run(process_id: int) -> dict:
  assert jax.process_count() == 2, jax.process_count()
  assert jax.device_count() == 4 and jax.local_device_count() == 2
  devices = np.asarray(jax.devices())  # process 0: devices 0, 1; process 1: 2, 3
  checks = []

  # The MLP block over a 4-device tensor-parallel axis spanning both processes.
  tp4 = Mesh(devices, ("tp",))
  values = random_inputs(100, [(N, S, K), (K, F), (F, K), (F,), (K,)], jnp.float32)
  tokens = P("tp", None, None)
  for routing in ("xla", "fused_hidden"):
    config = ROUTINGS[routing]
    _check(f"mlp[{routing}]",
           lambda *a, c=config: sharded.mlp(*a, mesh=tp4, config=c),
           _mlp_reference, tp4, values,
           [tokens, P(None, "tp"), P("tp", None), P("tp"), P()], 100, checks)

  # Column- and row-parallel layers with data parallelism; each tensor-parallel
  # group {0, 2}, {1, 3} spans both processes.
  dp_tp = Mesh(devices.reshape(2, 2).T, ("dp", "tp"))
  data = ("dp",)
  x, kernel, bias = random_inputs(200, [(N, S, K), (K, F), (F,)], jnp.float32)
  _check("column_parallel_dense",
         lambda *a: sharded.column_parallel_dense(*a, mesh=dp_tp, data_axes=data),
         lambda x, k, b: (x @ k + b,), dp_tp, [x, kernel, bias],
         [P(("dp", "tp"), None, None), P(None, "tp"), P("tp")], 200, checks)
  h, kernel, bias = random_inputs(300, [(N, S, F), (F, K), (K,)], jnp.float32)
  _check("row_parallel_dense",
         lambda *a: sharded.row_parallel_dense(*a, mesh=dp_tp, data_axes=data),
         lambda h, k, b: (h @ k + b,), dp_tp, [h, kernel, bias],
         [P("dp", None, "tp"), P("tp", None), P()], 300, checks)

  unique_id = _connect_with_stand_in(tp4, process_id, checks)
  return {"checks": checks, "unique_id": unique_id.hex()}


class _StandIn:
  """The C++ extension's part of connect, recorded."""

  def __init__(self):
    self.unique_ids = []

  def cublasmp_version(self):
    return 1000

  def nccl_version(self):
    return 23203

  def nccl_unique_id(self):
    return os.urandom(128)

  def connect(self, groups, connect_timeout_s, call_timeout_s, time_gemms):
    self.unique_ids += [unique_id for _, unique_id, _, _ in groups]

  def bind(self, ident, device_groups):
    pass

  def contexts(self):
    return []  # no context refused cuBLASMp's workspace

  def shutdown(self, timeout_s):
    return True  # every context released in time


def _connect_with_stand_in(mesh, process_id, checks) -> bytes:
  """connect across both processes through the real key-value store; process
  0 then lowers a cuBLASMp program for the GPU while process 1 waits (no
  peer is needed, so nothing blocks); then both see a disagreement."""
  native = _StandIn()
  REGISTRY._status, REGISTRY._native = Capability(True, "stand-in"), native
  communicators.self_test = lambda mesh, axis, ident, layout, version, *workspace: {
      key: Capability(True, "stand-in") for key in capability._cases(4, layout)}
  jcg.connect(mesh, "tp")
  (unique_id,) = native.unique_ids
  checks.append("connect")
  if process_id == 0:
    config = jcg.CommGemmConfig(backend="cublasmp")
    program = jax.jit(jax.shard_map(
        lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config), mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
    args = (jax.ShapeDtypeStruct((16, 8), jnp.float32),
            jax.ShapeDtypeStruct((8, 16), jnp.float32))
    text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_comm_gemm_all_gather_matmul" in text
    checks.append("lowered alone")
  fingerprint = {"JAX_COMM_GEMM_TIMEOUT": "300" if process_id == 0 else "60"}
  try:
    agreement.check(fingerprint, comm_id=1, attempt=1, processes=[0, 1], timeout_s=60)
  except agreement.DisagreementError as e:
    assert "JAX_COMM_GEMM_TIMEOUT differs (process 0: '300'; process 1: '60')" in str(e), e
    checks.append("disagreement raised")
  return unique_id


def disagree(process_id: int) -> dict:
  """connect on a CPU mesh over both processes, each run with its own
  JAX_COMM_GEMM_BACKEND (the launcher sets them apart): both must raise a
  DisagreementError naming the setting and the processes, before any
  collective, and quickly."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(4), ("tp",))
  try:
    jcg.connect(mesh, "tp")
  except agreement.DisagreementError as e:
    return {"checks": ["disagreement raised"], "message": str(e)}
  raise AssertionError("connect did not raise a DisagreementError")


def run_and_report(process_id: int, port: int, body) -> int:
  """Joins the other process through jax.distributed, runs ``body()`` and prints
  its dict as one JSON line (with "process", "ok" and any "error"); returns the
  exit status. The multi-process tests' workers all end this way."""
  result = {"process": process_id, "ok": False}
  try:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    try:
      result.update(body())
      result["ok"] = True
    finally:
      jax.distributed.shutdown()
  except Exception:  # noqa: BLE001  (reported to the test as JSON)
    result["error"] = traceback.format_exc()
  print(json.dumps(result), flush=True)
  return 0 if result["ok"] else 1


def main() -> int:
  process_id, port = int(sys.argv[1]), int(sys.argv[2])
  scenario = disagree if sys.argv[3:] == ["disagree"] else run
  return run_and_report(process_id, port, lambda: scenario(process_id))


if __name__ == "__main__":
  sys.exit(main())
