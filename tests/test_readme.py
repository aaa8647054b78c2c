"""The README's Python code blocks, run as written: in order, as one script (each
block builds on the ones before it), in a fresh interpreter on 8 simulated CPU
devices, as a user would paste them. Every block prints what it made, and a
comment says what: ``# ... prints <text>`` or, where a GPU prints something
else, ``# on CPU: <text>``. Each such text must be in the output of its block."""

import os
import pathlib
import re
import subprocess
import sys

from conftest import CPU_TEST_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = "--- README block {} ---"
# A comment that says what a block prints: "# ... prints <text>" or "# on CPU: <text>".
SAYS = re.compile(r"#(?:.*?\bprints|\s*on CPU:)\s+(.+?)\s*$")


def python_blocks(text: str) -> list[str]:
  """The ```python blocks of a Markdown text, in order."""
  return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def said(block: str) -> list[str]:
  """What the block's comments say it prints, in order."""
  return [m.group(1) for line in block.splitlines() if (m := SAYS.search(line))]


def test_said_reads_both_forms():
  block = ('print(y.shape)   # prints (2, 3)\nprint(r)\n# on CPU: no GPU: why\n'
           'y = f(x)   # a comment\nprint(z)   # like x: prints 4\n')
  assert said(block) == ["(2, 3)", "no GPU: why", "4"]


def test_the_readme_blocks_run_and_print_what_they_say(tmp_path):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 5, "the README's quick start lost its code blocks"
  script = "\n".join(f"print({MARK.format(i)!r}, flush=True)\n{block}"
                     for i, block in enumerate(blocks))
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMM_GEMM_AUTOTUNE_CACHE="",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CPU_TEST_FLAGS}",
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")])))
  env.pop("JAX_COMM_GEMM_BACKEND", None)
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, timeout=300, cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  outputs = re.split(r"^--- README block \d+ ---\n", proc.stdout, flags=re.M)[1:]
  assert len(outputs) == len(blocks), proc.stdout
  for i, (block, output) in enumerate(zip(blocks, outputs)):
    assert output.strip(), f"README block {i} prints nothing:\n{block}"
    for text in said(block):
      assert text in output, f"README block {i} says it prints {text!r}; it printed:\n{output}"
