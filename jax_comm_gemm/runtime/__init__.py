"""The cuBLASMp runtime, below the backends: ``constants`` (shared with the C++
extension), ``settings`` (the JAX_COMM_GEMM_* variables), ``native`` (loading
the extension), ``registry`` (the one global state, with the ``sentinel``),
``communicators`` (``connect``, with ``agreement``, ``kv`` and ``capability``)
and ``plan`` (the routing plan)."""

from jax_comm_gemm.runtime.capability import Capability
from jax_comm_gemm.runtime.communicators import comm_id, connect
from jax_comm_gemm.runtime.registry import REGISTRY

__all__ = ["Capability", "REGISTRY", "comm_id", "connect"]
