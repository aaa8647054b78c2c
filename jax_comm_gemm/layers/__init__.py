"""The sequence-parallel dense layers: ``local`` (per-shard arrays, inside the
caller's shard_map) and ``sharded`` (global arrays; wraps shard_map)."""

from jax_comm_gemm.layers import local, sharded

__all__ = ["local", "sharded"]
