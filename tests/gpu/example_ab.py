"""Runs the main example (examples/train_byte_gpt.py) on this machine's GPUs in
both process modes, one after the other: one process driving every GPU, then
one process per GPU (--processes N). Keeps each run's output and JSON summary
in OUT_DIR and ends with each run's A/B lines (backend "auto" against "xla").

  python tests/gpu/example_ab.py OUT_DIR [example options...]

Example options go to both runs (for instance --steps 30 --ab-steps 20). The
first run saves its checkpoints under the system's temp directory (the GPU
size's are about 10 GB: not in OUT_DIR); the second saves none. Exits non-zero
if a run fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_byte_gpt.py"
TIMEOUT_S = float(os.environ.get("JCG_EXAMPLE_TIMEOUT_S", "900"))


def gpu_count() -> int:
  if shutil.which("nvidia-smi") is None:
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def run(name: str, out_dir: pathlib.Path, flags: list[str]) -> dict | None:
  env = dict(os.environ)
  env.pop("JAX_PLATFORMS", None)  # a pytest parent pins the CPU; the example needs GPUs
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  summary = out_dir / f"{name}.json"
  cmd = [sys.executable, str(EXAMPLE), *flags, "--json-out", str(summary)]
  print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
  with open(out_dir / f"{name}.log", "w") as log:
    try:
      code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
      code = "timeout"
  lines = (out_dir / f"{name}.log").read_text().splitlines()
  print("\n".join(line for line in lines if line.startswith(("  backend=", "  auto / xla",
                                                              "train loss", "  all-gathers",
                                                              "  fused AllGather"))))
  if code != 0 or not summary.exists():
    print(f"{name} FAILED ({code}); the last lines:\n" + "\n".join(lines[-30:]), flush=True)
    return None
  return json.loads(summary.read_text())


def main() -> int:
  out_dir = pathlib.Path(sys.argv[1])
  out_dir.mkdir(parents=True, exist_ok=True)
  extra = sys.argv[2:]
  n = gpu_count()
  if n < 2:
    print(f"needs 2 GPUs, nvidia-smi lists {n}")
    return 2
  results = {"one_process": run("one_process", out_dir, extra),
             "process_per_gpu": run("process_per_gpu", out_dir,
                                    [*extra, "--processes", str(n), "--no-checkpoint"])}
  (out_dir / "example_ab.json").write_text(json.dumps(
      {k: v and v.get("ab") for k, v in results.items()}, indent=2))
  return 0 if all(results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
