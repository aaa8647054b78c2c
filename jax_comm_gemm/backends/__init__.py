"""Backends: how one AllGather+GEMM or GEMM+ReduceScatter runs inside shard_map.
``base``: the interface; ``xla``: XLA's collectives and the ring; ``primitives``:
the extension's fused ops (``CublasMpBackend``); ``pallas``: jax's Pallas
Mosaic GPU kernel; ``routes``: every routing decision, ``backend="auto"``'s
included; ``tuning``: ``autotune`` and ``autotune_step``. A new backend is one
module here implementing ``base.Backend``."""

from jax_comm_gemm.backends.base import Backend
from jax_comm_gemm.backends.pallas import PallasBackend
from jax_comm_gemm.backends.primitives import CublasMpBackend
from jax_comm_gemm.backends.routes import AutoBackend, Choice, choose_backend, resolve_backend
from jax_comm_gemm.backends.tuning import TunedStep, autotune, autotune_step, problems_of
from jax_comm_gemm.backends.xla import (RingBackend, XlaBackend, all_gather_tokens,
                                        gathered_matmul_t, local_matmul, ring_all_gather_matmul,
                                        ring_matmul_reduce_scatter, weight_gradient)
from jax_comm_gemm.runtime.capability import Capability

__all__ = ["AutoBackend", "Backend", "Capability", "Choice", "CublasMpBackend", "PallasBackend",
           "RingBackend", "TunedStep", "XlaBackend", "all_gather_tokens", "autotune",
           "autotune_step", "choose_backend", "gathered_matmul_t", "local_matmul", "problems_of",
           "resolve_backend", "ring_all_gather_matmul", "ring_matmul_reduce_scatter",
           "weight_gradient"]
