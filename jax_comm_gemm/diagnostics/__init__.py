"""What a program does, as opposed to what it computes: collective counts in
compiled HLO (``hlo``) and the path each layer takes, with the reason
(``report``)."""

from jax_comm_gemm.diagnostics import hlo, report

__all__ = ["hlo", "report"]
