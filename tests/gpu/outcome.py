"""One check's outcome over the ranks of a GPU job, from each process's result
(worker.py's JCG_CHECK lines): it fails where any rank failed or the ranks
disagree (one skipped, another ran), and is skipped only where every rank
skipped it for the same reason. Pure, so the CPU suite tests it
(tests/test_gpu_outcome.py)."""

from __future__ import annotations

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def outcome(per_process: list[dict]) -> tuple[str, str]:
  """(PASSED | FAILED | SKIPPED, why) of one check from every process's result.

  >>> outcome([{"ok": True}, {"ok": True, "skipped": "needs X"}])[0]
  'failed'
  >>> outcome([{"ok": True, "skipped": "needs X"}] * 2)
  ('skipped', 'needs X')
  """
  if not per_process:
    return FAILED, "no process reported"
  failed = [(pid, r) for pid, r in enumerate(per_process) if not r.get("ok")]
  if failed:
    return FAILED, "\n".join(f"process {pid}: {r.get('error')}\n{r.get('traceback', '')}"
                             for pid, r in failed)
  reasons = {r.get("skipped") or None for r in per_process}
  if reasons == {None}:
    return PASSED, ""
  if len(reasons) == 1:
    return SKIPPED, reasons.pop()
  said = ", ".join(f"process {pid} " + (f"skipped ({r['skipped']})" if r.get("skipped")
                                        else "passed")
                   for pid, r in enumerate(per_process))
  return FAILED, f"the ranks disagree: {said}"
