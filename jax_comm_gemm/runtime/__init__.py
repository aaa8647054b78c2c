"""The cuBLASMp runtime: the extension, the communicators and the capability
verdicts. Nothing here imports the layers above it (backends, layers, flax).

* ``constants``: values shared with the C++ extension, defined once.
* ``settings``: the JAX_COMM_GEMM_* environment variables.
* ``native``: loading the extension and its libraries.
* ``registry``: the one piece of global state (``REGISTRY``), with the
  ``sentinel`` thread that ends a process left stuck by an aborted group.
* ``communicators``: ``connect``, the collective set-up of a mesh axis, with ``agreement``
  (do the processes agree?), ``kv`` (the key-value store) and ``capability``
  (the layout self-test).
"""

from jax_comm_gemm.runtime.capability import Capability
from jax_comm_gemm.runtime.communicators import comm_id, connect
from jax_comm_gemm.runtime.registry import REGISTRY

__all__ = ["Capability", "REGISTRY", "comm_id", "connect"]
