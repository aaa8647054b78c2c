"""Training loss per step of example runs (train_byte_gpt.py --json-out), one
line each, as a PNG; prints each run's first and highest loss after step 1.

  python benchmarks/plot_loss.py OUT.png bf16=run_bf16.json fp8=run_fp8.json
"""

import json
import sys


def main(out: str, runs: list[str]) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4))
  for run in runs:
    label, _, path = run.partition("=")
    with open(path) as f:
      train = json.load(f)["history"]["train"]
    steps, losses = [int(s) for s, _ in train], [float(v) for _, v in train]
    ax.plot(steps, losses, label=label)
    print(f"{label}: first {losses[0]:.4f} (step {steps[0]}), highest after it "
          f"{max(losses[1:], default=float('nan')):.4f}, last {losses[-1]:.4f} (step {steps[-1]})")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=120)


if __name__ == "__main__":
  if len(sys.argv) < 3:
    sys.exit(__doc__)
  main(sys.argv[1], sys.argv[2:])
