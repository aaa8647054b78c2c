"""The NNX modules spell out their arguments as :class:`flax.nnx.Linear` does:
keyword-only, typed, with defaults, each documented in the docstring's Args;
and they are the linen module's fields, with the same defaults, so that the
two cannot drift apart."""

import dataclasses
import inspect
import re

import pytest

from jax_comm_gemm import linen as L
from jax_comm_gemm import nnx as N
from jax_comm_gemm.flax.nnx import LINEAR_ARGUMENTS

PAIRS = [(N.ColumnParallelDense, L.ColumnParallelDense),
         (N.RowParallelDense, L.RowParallelDense),
         (N.SequenceParallelMLP, L.SequenceParallelMLP),
         (N.SequenceParallelTransformerBlock, L.SequenceParallelTransformerBlock),
         (N.SequenceParallelLlamaBlock, L.SequenceParallelLlamaBlock)]
# Each side's own API beyond the shared fields: Flax Dense's (linen) and
# Flax Linear's (NNX) arguments, and linen's parent and name.
LINEN_ONLY = ("parent", "name", "promote_dtype", "dot_general", "dot_general_cls")
# The linen dense modules' output width, features, is the NNX ones' out_features.
RENAMED = {"features": "out_features"}
IDS = [cls.__name__ for cls, _ in PAIRS]


def _nnx_parameters(cls) -> dict[str, inspect.Parameter]:
  return dict(inspect.signature(cls.__init__).parameters)


def _keyword_defaults(cls) -> dict:
  """The NNX module's keyword-only arguments (not rngs, not Linear's) and their defaults."""
  return {name: p.default for name, p in _nnx_parameters(cls).items()
          if p.kind is p.KEYWORD_ONLY and name != "rngs" and name not in LINEAR_ARGUMENTS}


def _linen_fields(cls) -> tuple[list[str], dict]:
  """The linen module's required fields, and its fields with defaults."""
  fields = [f for f in dataclasses.fields(cls) if f.name not in LINEN_ONLY]
  required = [f.name for f in fields if f.default is dataclasses.MISSING]
  return required, {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("nnx_cls, linen_cls", PAIRS, ids=IDS)
def test_the_nnx_arguments_are_the_linen_fields_with_their_defaults(nnx_cls, linen_cls):
  required, defaults = _linen_fields(linen_cls)
  positional = [name for name, p in _nnx_parameters(nnx_cls).items()
                if p.kind is p.POSITIONAL_OR_KEYWORD][2:]  # after self, in_features
  assert positional == [RENAMED.get(name, name) for name in required]
  assert _keyword_defaults(nnx_cls) == defaults


@pytest.mark.parametrize("nnx_cls", [cls for cls, _ in PAIRS], ids=IDS)
def test_every_argument_is_typed_and_documented(nnx_cls):
  params = {name: p for name, p in _nnx_parameters(nnx_cls).items() if name != "self"}
  assert params["rngs"].kind is inspect.Parameter.KEYWORD_ONLY
  assert all(p.annotation is not inspect.Parameter.empty for p in params.values())
  args = inspect.getdoc(nnx_cls).split("Args:\n", 1)[1].split("\n\n", 1)[0]
  undocumented = [name for name in params if not re.search(rf"\b{name}\b", args)]
  assert not undocumented, f"{nnx_cls.__name__}'s Args do not name {undocumented}"


def test_the_comparison_sees_a_default_that_drifted(monkeypatch):
  """A planted NNX default that differs from linen's is caught, and only it."""
  init = N.RowParallelDense.__init__
  monkeypatch.setattr(init, "__kwdefaults__", init.__kwdefaults__ | {"axis_name": "model"})
  _, defaults = _linen_fields(L.RowParallelDense)
  drifted = _keyword_defaults(N.RowParallelDense)
  assert {k for k in defaults if drifted[k] != defaults[k]} == {"axis_name"}
