"""jax.distributed's key-value store: how the processes of a job exchange the few
bytes that set-up needs (NCCL unique ids, fingerprints, measured times and the
choices made from them). Keys carry the attempt, so that a retry never meets
an older attempt's values; in a single process a value only makes a JSON round
trip, so that every process sees the same types."""

from __future__ import annotations

import json

import jax
# jax has no public key-value API: jax.distributed exports initialize,
# is_initialized and shutdown only, and neither jax.extend nor
# jax.experimental hands out the client (jax's own checkpointing and
# multihost_utils read jax._src.distributed.global_state.client too). So this
# is the project's one private jax import (a test holds it here).
# Tested with jax 0.10.2 and 0.11.2, where jax.distributed.initialize() sets it.
from jax._src import distributed


def _client():
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError(
        "jax_comm_gemm: several JAX processes but no jax.distributed client; "
        "call jax.distributed.initialize() first")
  return client


def key(comm_id: int, attempt: int, *parts) -> str:
  return "/".join(["jax_comm_gemm", f"{comm_id:016x}", f"attempt{attempt}",
                   *map(str, parts)])


def publish(name: str, value: str) -> None:
  _client().key_value_set(name, value)


def fetch(name: str, timeout_s: float) -> str:
  """The value under `name`, waiting up to `timeout_s` for a peer to set it."""
  try:
    return _client().blocking_key_value_get(name, int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001  (jaxlib's error type varies by version)
    raise TimeoutError(
        f"jax_comm_gemm: no value for {name!r} within {timeout_s:g} s: a peer process did "
        f"not reach jax_comm_gemm.connect (every process must call it for the same mesh "
        f"axis; raise JAX_COMM_GEMM_CONNECT_TIMEOUT for slow starts): {e}") from e


def listing(prefix: str) -> list[tuple[str, str]]:
  """Every (key, value) under `prefix` now, without waiting."""
  return list(_client().key_value_dir_get(prefix))


def multi_process() -> bool:
  return jax.process_count() > 1


def _as_sent(value):
  """`value` as a peer receives it (tuples become lists, and so on)."""
  return json.loads(json.dumps(value))


def gather(comm_id: int, attempt: int, *parts, value, timeout_s: float) -> list | None:
  """Every process's `value`, in process order, in process 0; None in the others."""
  mine = _as_sent(value)
  if not multi_process():
    return [mine]
  me = jax.process_index()
  publish(key(comm_id, attempt, *parts, me), json.dumps(value))
  if me != 0:
    return None
  return [mine] + [json.loads(fetch(key(comm_id, attempt, *parts, other), timeout_s))
                   for other in range(1, jax.process_count())]


def all_gather(comm_id: int, attempt: int, *parts, value, timeout_s: float,
               processes: list[int] | None = None) -> list:
  """Every process's `value`, in process order, in every process; or, among
  `processes` (this one included), theirs in that order."""
  mine = _as_sent(value)
  if not multi_process():
    return [mine]
  me = jax.process_index()
  publish(key(comm_id, attempt, *parts, me), json.dumps(value))
  return [mine if other == me else json.loads(fetch(key(comm_id, attempt, *parts, other),
                                                    timeout_s))
          for other in (range(jax.process_count()) if processes is None else processes)]


def broadcast(comm_id: int, attempt: int, *parts, value, timeout_s: float):
  """Process 0's `value` in every process (the others' `value` is not read)."""
  if not multi_process():
    return _as_sent(value)
  name = key(comm_id, attempt, *parts, "from0")
  if jax.process_index() == 0:
    publish(name, json.dumps(value))
    return _as_sent(value)
  return json.loads(fetch(name, timeout_s))


def from_leader(comm_id: int, attempt: int, *parts, make, timeout_s: float):
  """``make()`` in process 0, its value in every process (the others do not
  call it): one view of a file or a cache for all, where each could differ."""
  value = make() if jax.process_index() == 0 else None
  return broadcast(comm_id, attempt, *parts, value=value, timeout_s=timeout_s)


def leader_decides(comm_id: int, attempt: int, *parts, value, decide, timeout_s: float):
  """Every process's `value` goes to process 0, which calls
  ``decide(values in process order)``; every process returns that decision.
  Deciding in one place and publishing it keeps every rank on the same
  choice even where their own measurements disagree."""
  values = gather(comm_id, attempt, *parts, value=value, timeout_s=timeout_s)
  decision = None if values is None else decide(values)
  return broadcast(comm_id, attempt, *parts, "decision", value=decision, timeout_s=timeout_s)
