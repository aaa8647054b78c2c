"""The sequence-parallel layers: ``dense`` (the dense layers, on local shards
and on global arrays) and ``transformer`` (the block built from them)."""
