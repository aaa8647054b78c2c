"""The project's text: it speaks of the project alone, and every path it names exists.

Two checks over the repository's files, plus checks of the checkers on planted text:

* No git-tracked text file says "session" followed by a number, or the word that
  BANNED spells out for a loaned machine: how the project is developed is no part of it. pytest's ``scope="session"`` is fine.
* Every repository path that README.md, benchmarks/README.md and docs/*.md name
  (in links, backticks or text), and every path that the code names
  (jax_comm_gemm/, xla_ffi/, examples/*.py, benchmarks/*.py and *.sh), exists; a link
  into a Markdown file with a ``#section`` names a heading of that file; nothing
  names DESIGN.md or the folder ../shared, which are not part of the repository.

Each failure lists every offender as ``file:line: ...``.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# "session" with a number after it, or the word for a loaned machine (case-insensitive).
BANNED = re.compile(r"\bsessions? [0-9]+|\blent\b", re.IGNORECASE)

_PREFIXES = r"(?:jax_comm_gemm|xla_ffi|docs|benchmarks|tests|examples)"
_EXTENSIONS = r"(?:py|cc|h|md|sh|json|txt)"
# A repository path with a folder prefix, to a file: resolved from the repository root.
FILE_PATH = re.compile(rf"(?<![\w./-]){_PREFIXES}/[\w./-]*?\.{_EXTENSIONS}(?![\w])")
# README.md or DESIGN.md with no folder: resolved from the naming file's own folder.
BARE_DOC = re.compile(r"(?<![\w./-])(README|DESIGN)\.md\b")
# Names that point outside the repository, wherever they occur.
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared\b")
# In Markdown: links, and backticked repository paths (folders too).
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_TICKED_PATH = re.compile(rf"`({_PREFIXES}/[\w./-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


# --- the files ------------------------------------------------------------------

def tracked_files() -> list[pathlib.Path]:
  """The git-tracked files that exist in the working tree."""
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("not a git checkout")
  out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                       capture_output=True).stdout.decode()
  return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


def read_text(path: pathlib.Path) -> str | None:
  """The file's text, or None for a binary file."""
  try:
    return path.read_bytes().decode("utf-8")
  except UnicodeDecodeError:
    return None


def doc_files() -> list[pathlib.Path]:
  return ([ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
          + sorted((ROOT / "docs").glob("*.md")))


def code_files() -> list[pathlib.Path]:
  files = sorted((ROOT / "jax_comm_gemm").rglob("*.py"))
  files += sorted(p for p in (ROOT / "xla_ffi").glob("*") if p.is_file())
  files += sorted((ROOT / "examples").glob("*.py"))
  files += sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.sh"))
  return [p for p in files if "__pycache__" not in p.parts]


# --- the checkers (pure: text in, offenders out) ----------------------------------

def banned_hits(name: str, text: str) -> list[str]:
  return [f"{name}:{n}: {m.group(0)!r} in: {line.strip()[:120]}"
          for n, line in enumerate(text.splitlines(), 1)
          for m in BANNED.finditer(line)]


def github_anchor(heading: str) -> str:
  """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_'
  dropped, spaces made '-' (Markdown emphasis and code marks are punctuation)."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
  """The anchors of a Markdown text's headings (outside fenced code), with
  GitHub's -1, -2 ... for repeats."""
  seen: dict[str, int] = {}
  out = set()
  fenced = False
  for line in text.splitlines():
    if line.lstrip().startswith("```"):
      fenced = not fenced
      continue
    m = None if fenced else HEADING.match(line)
    if m:
      base = github_anchor(m.group(2))
      count = seen.get(base, 0)
      seen[base] = count + 1
      out.add(base if count == 0 else f"{base}-{count}")
  return out


def _resolve(root: pathlib.Path, base: pathlib.Path, target: str) -> pathlib.Path:
  return (base / target).resolve()


def _inside(root: pathlib.Path, path: pathlib.Path) -> bool:
  try:
    path.relative_to(root)
    return True
  except ValueError:
    return False


def path_offenders(root: pathlib.Path, path: pathlib.Path, text: str,
                   markdown: bool) -> list[str]:
  """Every path that `text` (the contents of `path`) names and that does not exist
  in the repository at `root`; for Markdown also links, and anchors of headings."""
  name = path.relative_to(root).as_posix()
  out = []
  for n, line in enumerate(text.splitlines(), 1):
    where = f"{name}:{n}"
    for m in OUTSIDE.finditer(line):
      out.append(f"{where}: names {m.group(0)!r}, which is not in the repository")
    for m in FILE_PATH.finditer(line):
      token = m.group(0)
      if not (root / token).exists():
        out.append(f"{where}: {token} does not exist")
        continue
      anchor = re.match(r"#([\w-]+)", line[m.end():])
      if anchor and token.endswith(".md") and not markdown:
        # In code, docs/design.md#a-section; Markdown links are checked below.
        if anchor.group(1) not in anchors(read_text(root / token) or ""):
          out.append(f"{where}: {token}#{anchor.group(1)}: no such heading")
    for m in BARE_DOC.finditer(line):
      if m.group(1) == "DESIGN":
        continue  # reported above
      if not ((path.parent / m.group(0)).exists() or (root / m.group(0)).exists()):
        out.append(f"{where}: {m.group(0)} (from {path.parent.relative_to(root)}/) does not exist")
    if not markdown:
      continue
    for m in MD_TICKED_PATH.finditer(line):
      token = m.group(1)
      if FILE_PATH.fullmatch(token):
        continue  # checked above
      if not (root / token).exists():
        out.append(f"{where}: {token} does not exist")
    for m in MD_LINK.finditer(line):
      target = m.group(1)
      if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        continue  # a URL
      file_part, _, anchor = target.partition("#")
      if not file_part:
        if anchor not in anchors(text):
          out.append(f"{where}: link #{anchor}: no such heading in this file")
        continue
      dest = _resolve(root, path.parent, file_part)
      if not _inside(root, dest):
        out.append(f"{where}: link {target} points outside the repository")
        continue
      if not dest.exists():
        out.append(f"{where}: link {target} does not exist")
        continue
      if anchor and dest.suffix == ".md":
        dest_text = read_text(dest) or ""
        if anchor not in anchors(dest_text):
          out.append(f"{where}: link {target}: no heading with anchor #{anchor} in "
                     f"{dest.relative_to(root).as_posix()}")
  return out


# --- the checks on the repository -------------------------------------------------

def test_no_tracked_text_speaks_of_sessions_or_lending():
  hits = []
  for path in tracked_files():
    text = read_text(path)
    if text is not None:
      hits += banned_hits(path.relative_to(ROOT).as_posix(), text)
  assert not hits, "text about how the project is developed:\n" + "\n".join(hits)


def test_docs_name_only_paths_that_exist():
  missing = [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "docs" / "performance.md"]
  assert all(p.exists() for p in missing), [str(p) for p in missing if not p.exists()]
  offenders = []
  for path in doc_files():
    if path.exists():
      offenders += path_offenders(ROOT, path, path.read_text(encoding="utf-8"), markdown=True)
  assert not offenders, "the docs name what is not there:\n" + "\n".join(offenders)


def test_code_names_only_paths_that_exist():
  offenders = []
  for path in code_files():
    text = read_text(path)
    if text is not None:
      offenders += path_offenders(ROOT, path, text, markdown=False)
  assert not offenders, "the code names what is not there:\n" + "\n".join(offenders)


# --- the checkers catch what they should, on planted text --------------------------

def test_banned_catches_planted_text_and_spares_pytest_scope():
  word, session = "le" + "nt", "Se" + "ssion"  # kept out of this file's own text
  assert banned_hits("x", f"ran in {session} 3\n")
  assert banned_hits("x", f"{session.lower()}s 9 and 10")
  assert banned_hits("x", f"the machine {word} to us")
  assert not banned_hits("x", '@pytest.fixture(scope="session")\ndef f(): ...')
  assert not banned_hits("x", "gpu_session.sh runs the suite; a " + word + "il soup; silent")


def test_github_anchor():
  assert github_anchor("Ordering against XLA (the fence)") == "ordering-against-xla-the-fence"
  assert github_anchor("backend=auto and autotuning") == "backendauto-and-autotuning"
  assert github_anchor("Whole-step tuning (autotune_step)") == "whole-step-tuning-autotune_step"
  assert github_anchor("The `jax` private API") == "the-jax-private-api"
  assert anchors("# A\n## A\n```\n# not\n```\n") == {"a", "a-1"}


def test_path_checker_catches_planted_paths(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "jax_comm_gemm").mkdir()
  (tmp_path / "jax_comm_gemm" / "real.py").write_text("")
  (tmp_path / "README.md").write_text("# Top\n")
  (tmp_path / "docs" / "design.md").write_text("# Design\n## The fence\n")
  doc = tmp_path / "docs" / "performance.md"

  def offenders(text, path=doc, markdown=True):
    return path_offenders(tmp_path, path, text, markdown)

  good = ("`jax_comm_gemm/real.py`, [d](design.md#the-fence), [r](../README.md#top), "
          "[self](#perf), `jax_comm_gemm/`, https://example.com/x.md\n# Perf\n")
  assert offenders(good) == []
  assert offenders("see `jax_comm_gemm/gone.py`")
  assert offenders("see jax_comm_gemm/gone.py in prose")
  assert offenders("[d](design.md#no-such-heading)")
  assert offenders("[d](missing.md)")
  assert offenders("[x](../../outside.md)")
  assert offenders("`tests/gpu/`")
  assert offenders("as in DESIGN.md")
  assert offenders("see ../shared/notes")
  code = tmp_path / "jax_comm_gemm" / "real.py"
  assert offenders("# see README.md", path=code, markdown=False) == []  # the root's
  assert offenders("# see jax_comm_gemm/real.py:12", path=code, markdown=False) == []
  assert offenders("# see xla_ffi/gone.h", path=code, markdown=False)
  assert offenders("# (DESIGN.md)", path=code, markdown=False)
  assert offenders("# docs/design.md#the-fence", path=code, markdown=False) == []
  assert offenders("# docs/design.md#no-such-fence", path=code, markdown=False)
  assert offenders("[self](#nowhere)\n# Perf\n")
