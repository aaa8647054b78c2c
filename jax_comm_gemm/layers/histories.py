"""The FP8 amax histories that the MLP helpers carry for a "delayed" recipe,
one per dense layer, as ``fp8_histories={"fc1": ..., "fc2": ...}``: where to
get empty ones, and the check (the transformer block's are in
:mod:`jax_comm_gemm.layers.transformer`)."""

from __future__ import annotations

from jax_comm_gemm import validation
from jax_comm_gemm.config import CommGemmConfig
from jax_comm_gemm.fp8 import AmaxHistory

# The MLP's dense layers, as `fp8_histories` names them.
MLP_LAYERS = ("fc1", "fc2")


def init_mlp_fp8_histories(config: CommGemmConfig):
  """The MLP's empty FP8 amax histories (``{"fc1": ..., "fc2": ...}``) where
  `config`'s recipe is "delayed", else None. Pass them as ``fp8_histories``;
  the MLP's gradient with respect to them is the next step's (replace, do not
  apply: :class:`~jax_comm_gemm.fp8.AmaxHistory`).

  >>> import jax_comm_gemm as jcg
  >>> init_mlp_fp8_histories(jcg.CommGemmConfig()) is None
  True
  """
  if config.fp8 is None or config.fp8.scaling != "delayed":
    return None
  return {name: AmaxHistory.zeros(config.fp8) for name in MLP_LAYERS}


def mlp_histories(op: str, config, fp8_histories) -> dict:
  """`fp8_histories`, checked, as {layer: history, or None without a
  "delayed" recipe}."""
  checked = validation.check_fp8_histories(op, config, fp8_histories, MLP_LAYERS,
                                           "init_mlp_fp8_histories(config)")
  return checked or dict.fromkeys(MLP_LAYERS)
