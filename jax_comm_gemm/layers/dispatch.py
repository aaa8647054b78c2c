"""The one local-or-global dispatch of the front-ends.

A Flax module (linen or NNX; a dense layer or a transformer block) decides
where it runs with :func:`~jax_comm_gemm.layers.placement.place` and calls
:func:`run`, which picks the checked entry of that layer for that mode: on
local shards inside the caller's ``jax.shard_map`` (``local.py``,
``transformer.block_local``) or on global arrays (``sharded.py``,
``transformer.block_global``). The functional API calls those same entries.
"""

from __future__ import annotations

from types import MappingProxyType

from jax_comm_gemm.layers import local, sharded, transformer
from jax_comm_gemm.layers.placement import Placement
from jax_comm_gemm.validation import Names

# kind: (entry on local shards, entry on global arrays); each takes
# (names, *operands, where=Placement, **options).
ENTRIES = MappingProxyType({
    "column": (local.column_local, sharded.column_global),
    "row": (local.row_local, sharded.row_global),
    "block": (transformer.block_local, transformer.block_global),
})


def run(kind: str, where: Placement, names: Names, *operands, **options):
  """Runs layer `kind` (a key of ``ENTRIES``) where `where` says.

  >>> import jax, numpy as np
  >>> from jax_comm_gemm.config import DEFAULT_CONFIG
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> run("column", Placement(False, "tp", 1, mesh), Names("f"), np.ones((2, 3), np.float32),
  ...     np.ones((3, 4), np.float32), None, keep_gathered_input=False, precision=None,
  ...     config=DEFAULT_CONFIG).shape
  (2, 4)
  """
  on_local_shards, on_global_arrays = ENTRIES[kind]
  entry = on_local_shards if where.local else on_global_arrays
  return entry(names, *operands, where=where, **options)
