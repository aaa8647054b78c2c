"""jax.distributed's key-value store: how the processes of a job exchange the
few bytes that set-up needs (NCCL unique ids, fingerprints).

Keys carry the connect attempt, so that a retry after a failed connect never
meets the values of the attempt before it.
"""

from __future__ import annotations

import jax
from jax._src import distributed  # no public key-value API yet


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


def multi_process() -> bool:
  return jax.process_count() > 1
