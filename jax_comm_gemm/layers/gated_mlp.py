"""The gated MLP (SwiGLU, GeGLU) of Llama-class models, sequence-parallel:
``down(activation(x @ gate) * (x @ up))`` with gate and up in ONE
column-parallel op, so the input is gathered once forward and (as for the
GELU MLP) once or not at all backward.

The kernel of gate and up is ``[K, 2, F]``, split over the axis along F: each
shard holds ``[K, 2, F/P]``, its gate columns (``[:, 0]``) and its up columns
(``[:, 1]``), whatever P is; flattened to ``[K, 2*F/P]`` (no copy) it is one
column-parallel kernel whose output columns are ``({gate, up}, F/P)``. An
unsharded checkpoint's ``gate [K, F]`` and ``up [K, F]`` load as
``jnp.stack([gate, up], 1)``."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_comm_gemm import validation
from jax_comm_gemm.collective_matmul import scoped_activation
from jax_comm_gemm.config import DEFAULT_CONFIG, CommGemmConfig
from jax_comm_gemm.fp8 import prologue as fp8_prologue
from jax_comm_gemm.layers import dense
from jax_comm_gemm.runtime.registry import current_plan
from jax_comm_gemm.validation import Names


@functools.cache
def gated(activation: Callable) -> Callable:
  """``h -> activation(g) * u`` for h ``[..., 2*F]`` of columns ``({g, u},
  F)``, in h's dtype (the product of :func:`jax_comm_gemm.fp8.prologue.gated`,
  which an FP8 cast applies to g and u in place); named "swiglu" for silu,
  "geglu" for gelu (profiles and kernels name it so). Made once per activation.

  >>> gated(jax.nn.silu).__name__, gated(jax.nn.silu)(jnp.array([0.0, 2.0])).tolist()
  ('swiglu', [0.0])
  """
  product = fp8_prologue.gated(activation)

  def glu(h):
    return product(*jnp.split(h, 2, axis=-1))
  glu.__name__ = product.__name__
  return glu


def gated_mlp(x, gate_up_kernel, down_kernel, gate_up_bias=None, down_bias=None, *,
              axis_name: str, activation: Callable = jax.nn.silu,
              keep_gathered_input: bool = False, precision=None,
              config: CommGemmConfig = DEFAULT_CONFIG, fp8_histories=None):
  """The gated MLP on local shards, inside ``jax.shard_map`` over `axis_name`:
  x ``[n/P, ..., K]`` (this shard's tokens), gate_up_kernel ``[K, 2, F/P]``,
  down_kernel ``[F/P, K]``, gate_up_bias ``[2, F/P]`` and down_bias ``[K]``
  (x's dtype) or None; returns ``[n/P, ..., K]``. `activation`: the gate's
  (``jax.nn.silu``: SwiGLU, ``jax.nn.gelu``: GeGLU); the other options as in
  :func:`jax_comm_gemm.layers.dense.mlp` (the histories' names are "fc1",
  gate and up, and "fc2", down).

  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  >>> f = jax.shard_map(lambda x, a, b: gated_mlp(x, a, b, axis_name="tp"), mesh=mesh,
  ...                   in_specs=(P("tp"), P(None, None, "tp"), P("tp")), out_specs=P("tp"))
  >>> jax.jit(f)(jnp.ones((2, 3)), jnp.ones((3, 2, 8)), jnp.ones((8, 3))).shape
  (2, 3)
  """
  op = "gated_mlp"
  histories = dense._mlp_histories(op, config, fp8_histories)
  validation.bound_axis_size(op, axis_name)
  validation.check_callable(op, "activation", activation)
  options = dense.checked_options(op, keep_gathered_input, precision, config, None)
  check_gate_up(op, gate_up_kernel, gate_up_bias, np.shape(x)[-1])
  flat_bias = None if gate_up_bias is None else jnp.reshape(gate_up_bias, (-1,))
  dense.check_column(Names(op, kernel="gate_up_kernel", bias="gate_up_bias"), x,
                     flat(gate_up_kernel), flat_bias)
  want = (np.shape(gate_up_kernel)[2], np.shape(x)[-1])
  if np.shape(down_kernel) != want:
    raise ValueError(f"{op}: `down_kernel` must have shape {want} ([F/P, K]), got "
                     f"{np.shape(down_kernel)}")
  validation.check_bias(Names(op, bias="down_bias"), down_bias, np.shape(x)[-1], x)
  del options["dot_general"]
  return gated_mlp_parallel(x, gate_up_kernel, gate_up_bias, down_kernel, down_bias,
                            axis_name=axis_name, activation=activation,
                            fp8_histories=(histories["fc1"], histories["fc2"]),
                            plan=current_plan(), **options)


def check_gate_up(op: str, kernel, bias, features: int) -> None:
  """A gate-and-up kernel ``[K, 2, F/P]`` and its bias ``[2, F/P]`` (or None)."""
  shape = np.shape(kernel)
  if len(shape) != 3 or shape[1] != 2 or shape[0] != features:
    raise ValueError(f"{op}: `gate_up_kernel` must be [K, 2, F/P] (K = x's features, "
                     f"{features}; [:, 0] the gate, [:, 1] up), got shape {shape}")
  if bias is not None and np.shape(bias) != shape[1:]:
    raise ValueError(f"{op}: `gate_up_bias` must have shape {shape[1:]} ([2, F/P], as "
                     f"the kernel's last two dims), got {np.shape(bias)}")


def flat(kernel):
  """``[K, 2, F/P]`` as the column-parallel kernel ``[K, 2*F/P]`` (a reshape:
  no copy), its columns ``({gate, up}, F/P)``."""
  return jnp.reshape(kernel, (np.shape(kernel)[0], -1))


def product_inside(config: CommGemmConfig) -> bool:
  """Whether the gated product and its gradient run inside the FP8 casts (the
  MLP as one FP8 op): under every FP8 recipe. The benchmark's
  ``*_glu_outside`` variant turns it off to time the product in XLA's passes."""
  return config.fp8 is not None


def gated_mlp_parallel(x, gate_up_kernel, gate_up_bias, down_kernel, down_bias, *, axis_name,
                       activation, keep_gathered_input=False, precision=None,
                       config=DEFAULT_CONFIG, fp8_histories=(None, None), prologue=None,
                       plan):
  """:func:`gated_mlp` for callers that checked the arguments (`prologue` as in
  :func:`jax_comm_gemm.layers.dense.column_parallel`): gate and up in one
  column-parallel op, the gated product, then down, row-parallel. Under an
  FP8 recipe the three are one op (:func:`jax_comm_gemm.fp8.fp8_mlp` with the
  gated product): the product is made inside down's input cast from gate's
  and up's halves of the GEMM output, and its gradient ``[d gate, d up]``
  inside gate and up's gradient cast, neither written in x's dtype (per-row
  and block scaling: inside XLA's fusion of the cast). Without one XLA fuses
  the product into its producer and consumer."""
  bias = None if gate_up_bias is None else jnp.reshape(gate_up_bias, (-1,))
  if product_inside(config):
    return dense.mlp_parallel(x, flat(gate_up_kernel), bias, down_kernel, down_bias,
                              axis_name=axis_name,
                              activation=fp8_prologue.gated(activation),
                              keep_gathered_input=keep_gathered_input, precision=precision,
                              config=config, fp8_histories=fp8_histories, prologue=prologue,
                              plan=plan)
  h = dense.column_parallel(x, flat(gate_up_kernel), bias, axis_name=axis_name,
                            keep_gathered_input=keep_gathered_input, precision=precision,
                            config=config, fp8_history=fp8_histories[0], prologue=prologue,
                            plan=plan)
  a = scoped_activation(gated(activation), h)
  return dense.row_parallel(a, down_kernel, down_bias, axis_name=axis_name,
                            precision=precision, config=config, fp8_history=fp8_histories[1],
                            plan=plan)
