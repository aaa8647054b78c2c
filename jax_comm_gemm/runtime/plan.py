"""The routing plan: everything that decides how a layer runs, as one immutable
value: the settings, whether cuBLASMp can run and where it leaves the gathered
operand, the connected axes and the self-test's verdicts, and the choices
``autotune`` measured. The registry keeps the process's plan, which no
``jax.jit`` keys on; a :func:`use` scope runs code under a plan of its own
(``autotune_step``'s tuned step), and only programs traced inside it key on
that plan. Why: docs/design.md#routing-plan.

>>> plan = Plan(Settings(), Capability(False, "no GPU"), "front")
>>> plan.decision("a problem") is None
True
>>> tuned = plan.with_decisions({"a problem": ("xla", "measured")})
>>> with use(tuned):
...   scoped() is tuned
True
>>> scoped() is None
True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax

from jax_comm_gemm.runtime.capability import Capability, VerdictKey, untested
from jax_comm_gemm.runtime.settings import Settings


def axis_key(mesh, axis_name: str) -> tuple:
  """What trace time can see of a mesh axis (the abstract mesh inside
  shard_map has names and sizes, not devices)."""
  return (axis_name, tuple(mesh.axis_names), tuple(int(s) for s in mesh.shape.values()))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """What decides every route (see the module docstring): the `settings`, whether
  cuBLASMp can run (`cublasmp`), where it leaves the gathered operand
  (`layout`), the connected `axes` ((axis_key, comm_id)), the self-test's
  `verdicts`, and autotune's `decisions` ((problem, (implementation, why))).
  `tag` only makes two otherwise equal plans differ (a trace under a new tag
  runs the library's trace-time code afresh); `problems` is the list a trace
  under this plan appends its problems to (``tuning.problems_of``'s), None
  everywhere else: tracing writes nothing."""

  settings: Settings
  cublasmp: Capability
  layout: str
  axes: tuple = ()
  verdicts: tuple = ()
  decisions: tuple = ()
  tag: int = 0
  problems: list | None = None

  def __post_init__(self):
    # jit hashes and compares the plan in force at every call: do it once.
    key = (self.settings, self.cublasmp, self.layout, frozenset(self.axes),
           frozenset(self.verdicts), frozenset(self.decisions), self.tag)
    object.__setattr__(self, "_key", key)
    object.__setattr__(self, "_hash", hash(key))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, Plan) and self._hash == other._hash
                             and self._key == other._key)

  @functools.cached_property
  def _axes(self) -> dict:
    return dict(self.axes)

  @functools.cached_property
  def _verdicts(self) -> dict:
    return dict(self.verdicts)

  @functools.cached_property
  def _decisions(self) -> dict:
    return dict(self.decisions)

  def comm_id(self, mesh, axis_name: str) -> int | None:
    """The comm_id of a connected mesh axis, or None."""
    return self._axes.get(axis_key(mesh, axis_name))

  def verdict(self, key: VerdictKey) -> Capability:
    """The self-test's verdict for `key`; a failing one where none was taken."""
    found = self._verdicts.get(key)
    return found if found is not None else untested(key)

  def decision(self, problem) -> tuple[str, str] | None:
    """The measured (implementation, why) for `problem`, or None."""
    return self._decisions.get(problem)

  def with_decisions(self, decisions: Mapping[Any, tuple[str, str]]) -> "Plan":
    """This plan with `decisions` added (replacing any for the same problem)."""
    merged = {**self._decisions, **{p: tuple(d) for p, d in decisions.items()}}
    return dataclasses.replace(self, decisions=tuple(merged.items()))

  def with_axis(self, mesh, axis_name: str, comm_id: int,
                verdicts: Mapping[VerdictKey, Capability]) -> "Plan":
    """This plan with a connected axis and its verdicts added."""
    axes = {**self._axes, axis_key(mesh, axis_name): comm_id}
    merged = {**self._verdicts, **verdicts}
    return dataclasses.replace(self, axes=tuple(axes.items()), verdicts=tuple(merged.items()))


# The plan of a use() scope, else None. Its value outside any scope never
# changes, so the programs traced outside one never trace again because of it.
_SCOPE = jax.make_user_context(default_value=None)


def scoped() -> Plan | None:
  """The plan of the innermost use() scope on this thread, or None."""
  return _SCOPE.value


def use(plan: Plan):
  """A context manager that runs its body under `plan` (this thread only);
  programs traced in it key on `plan`."""
  return _SCOPE(plan)
