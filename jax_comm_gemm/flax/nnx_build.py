"""What the NNX modules' constructors share: their keyword-only arguments as
one dict (:func:`arguments`), checked (:func:`init_options`), and parameters
made with their sharding metadata (:func:`make_param`)."""

from __future__ import annotations

import contextlib
import inspect
from types import MappingProxyType

import jax
from flax import nnx

from jax_comm_gemm.flax.common import check_options, check_split
from jax_comm_gemm.layers import dense


def arguments(init, values: dict) -> dict:
  """The keyword-only arguments of `init` (an ``__init__``) but ``rngs``, as
  `values` (its ``locals()``) holds them.

  >>> def init(self, n, *, use_bias=True, rngs=None):
  ...   return arguments(init, locals())
  >>> init(None, 3)
  {'use_bias': True}
  """
  return {name: values[name] for name, p in inspect.signature(init).parameters.items()
          if p.kind is p.KEYWORD_ONLY and name != "rngs"}


def init_options(owner: str, given: dict, features: dict[str, int], split: str) -> dict:
  """A module's options at construction (`given`: the table's and the
  module's own), checked; where a mesh is known (given or from
  ``jax.set_mesh``), `split` (a key of `features`) must split over it.

  >>> from jax_comm_gemm.flax.common import DEFAULTS
  >>> init_options("M", DEFAULTS | {"use_bias": "no"}, {"features": 4}, "features")
  Traceback (most recent call last):
  ...
  TypeError: M: `use_bias` must be True or False, got 'no' (str)
  """
  options = dict(given)
  options["data_axes"] = check_options(owner, options, features=features)
  known = known_mesh(options["mesh"])
  if known is not None:
    size, _ = dense.check_mesh(owner, known, options["axis_name"], options["data_axes"])
    check_split(f"{owner}.{split}", features[split], options["axis_name"], size)
  return options


def known_mesh(mesh):
  """`mesh`, or the one set by ``jax.set_mesh``, or None."""
  if mesh is not None:
    return mesh
  context = jax.sharding.get_abstract_mesh()
  return None if context.empty else context


def make_param(init, key, shape, dtype, names, mesh, metadata=MappingProxyType({}),
               kind=nnx.Param):
  """An ``nnx.Param`` (or another Variable type, `kind`) with ``out_sharding``
  `names` (and `metadata`), placed on the mesh if one is known.

  >>> make_param(nnx.initializers.ones, jax.random.key(0), (2,), "float32", (None,),
  ...            None).get_metadata("out_sharding")
  (None,)
  """
  metadata = {**metadata, "out_sharding": names}
  if mesh is not None:
    metadata["mesh"] = mesh
  # Flax shards a variable with out_sharding metadata when it is created, and
  # that needs a mesh; without one, keep the metadata and place it later.
  quiet = (contextlib.nullcontext() if known_mesh(mesh) is not None
           else nnx.use_eager_sharding(False))
  with quiet:
    return kind(init(key, shape, dtype), **metadata)
