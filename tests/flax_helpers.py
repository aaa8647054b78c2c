"""What the linen and NNX module tests share: meshes, specs and references."""

import jax
import numpy as np
import pytest
from conftest import cpu_mesh
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_comm_gemm import CommGemmConfig

TOKENS, K, F = 16, 16, 32  # tokens, model width, hidden width (8 devices at most)


def dp_tp_mesh() -> Mesh:
  devices = jax.devices("cpu")
  if len(devices) < 8:
    pytest.skip("needs 8 CPU devices")
  return Mesh(np.asarray(devices[:8]).reshape(2, 4), ("dp", "tp"))


MESHES = {"tp4": lambda: cpu_mesh(4), "dp2xtp4": dp_tp_mesh}


def data_axes(mesh) -> tuple:
  return tuple(a for a in mesh.axis_names if a != "tp")


def tokens_spec(mesh, ndim=2) -> P:
  """Sharded along tokens over every axis (between layers)."""
  return P((*data_axes(mesh), "tp"), *(None,) * (ndim - 1))


def features_spec(mesh, ndim=2) -> P:
  """Tokens over the data axes, features over 'tp' (inside an MLP)."""
  return P(data_axes(mesh) or None, *(None,) * (ndim - 2), "tp")


def dense_ref(p, x):
  return x @ p["kernel"] + p["bias"]


def mlp_ref(p, x):
  return dense_ref(p["fc2"], jax.nn.gelu(dense_ref(p["fc1"], x)))


# What the modules' option tests set: each shows in the gradient program.
OPTIONS = dict(precision=lax.Precision.HIGHEST, config=CommGemmConfig(backend="ring"))


def assert_options_show(step, args, every_dot: bool = True) -> None:
  """`step` (jitted, on `args`) runs its ops on the ring (ppermutes) and its
  dots at HIGHEST: every dot, or (``every_dot=False``, where attention's own
  products keep jax's default) some."""
  jaxpr = str(jax.make_jaxpr(step)(*args))
  assert "ppermute" in jaxpr
  dots, highest = jaxpr.count("dot_general["), jaxpr.count("precision=(Precision.HIGHEST")
  assert highest > 0 and (highest == dots or not every_dot), (dots, highest)
