"""Do the processes of a tensor-parallel group agree on how they will run? Ranks
that differ in a setting that changes what they enqueue (every
``JAX_COMM_GEMM_*`` setting, the library versions) would hang or overrun a
peer's workspace, so at connect every process publishes a fingerprint of them
through the key-value store, and a mismatch is a :class:`DisagreementError`
naming the setting and the processes, before any collective runs."""

from __future__ import annotations

import jax_comm_gemm.runtime.kv as kv


class DisagreementError(ValueError):
  """The processes of a tensor-parallel group were set up differently."""


def compare(fingerprints: dict[int, dict[str, str]]) -> str | None:
  """None when every process has the same fingerprint, else a message naming
  each setting that differs and which processes have which value."""
  fields = sorted(set().union(*(fp.keys() for fp in fingerprints.values())))
  problems = []
  for field in fields:
    by_value: dict[str, list[int]] = {}
    for process, fp in sorted(fingerprints.items()):
      by_value.setdefault(fp.get(field, "<missing>"), []).append(process)
    if len(by_value) > 1:
      sides = "; ".join(f"process{'es' if len(p) > 1 else ''} {', '.join(map(str, p))}: "
                        f"{value!r}" for value, p in by_value.items())
      problems.append(f"{field} differs ({sides})")
  if not problems:
    return None
  return ("jax_comm_gemm: the processes of the tensor-parallel group disagree: "
          + "; ".join(problems) + ". Every process must run with the same settings.")


def check(fingerprint: dict[str, str], *, comm_id: int, attempt: int,
          processes: list[int], timeout_s: float) -> None:
  """Exchanges fingerprints among `processes` (this one among them) and raises
  DisagreementError on any difference. Every process sees every fingerprint,
  so all of them raise, each with the same message."""
  if len(processes) < 2:
    return
  seen = kv.all_gather(comm_id, attempt, "fingerprint", value=fingerprint, timeout_s=timeout_s,
                       processes=processes)
  message = compare(dict(zip(processes, seen)))
  if message:
    raise DisagreementError(message)
