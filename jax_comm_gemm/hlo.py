"""Public name of the HLO collective counting (it lives in
``jax_comm_gemm.diagnostics.hlo``)."""

from jax_comm_gemm.diagnostics.hlo import (CollectiveCounts, compiled_collectives,
                                           count_collectives)

__all__ = ["CollectiveCounts", "compiled_collectives", "count_collectives"]
