"""Bytes of the Python standard library's own source files, for a byte-level
language model: text that every machine with Python has, without a download.

The ``*.py`` files under a directory (by default the standard library's,
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``) are split by
file into a training and a validation part, so that no validation text is ever
trained on. Each part reads as one stream of bytes: its files in sorted order,
each followed by a NUL byte that marks the end of a file.

A batch is ``batch`` windows of ``length`` consecutive bytes at random offsets
of a part's stream (nanoGPT's sampling), read from disk as needed (the files
that were read last are kept in memory). The offsets are drawn from
``(seed, part, step)``, so a batch is a pure function of its step: the same for
every process of a multi-process run, the same after a restart, and a resumed
run continues the stream where it stopped.

Which part a file is in depends on a hash of its path relative to the
directory alone, so the split is the same for every seed and every machine that
has the same files.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np

SEPARATOR = b"\0"  # after each file: Python source holds no NUL bytes
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
PARTS = ("train", "validation")


def stdlib_dir() -> pathlib.Path:
  """The directory of this Python's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of the corpus: its files and where each starts in its stream."""
  files: tuple[pathlib.Path, ...]
  starts: tuple[int, ...]  # offset of each file in the stream
  size: int                # bytes in the stream, separators included


class ByteCorpus:
  """The ``pattern`` files under ``root``, split into ``train`` and
  ``validation`` by file.

  Args:
    root: the directory to read (default: the standard library's).
    validation_fraction: the share of files held out, at least one file.
    pattern: which files hold the text.
    cached_files: how many files to keep in memory.

  Raises:
    FileNotFoundError: ``root`` does not exist (NotADirectoryError: not a directory).
    ValueError: no non-empty ``pattern`` file under ``root``, or only one, which
      cannot be split.
  """

  def __init__(self, root=None, *, validation_fraction: float = 0.05,
               pattern: str = "*.py", cached_files: int = 512):
    self.root = pathlib.Path(stdlib_dir() if root is None else root)
    if not self.root.exists():
      raise FileNotFoundError(f"text directory {self.root} does not exist")
    if not self.root.is_dir():
      raise NotADirectoryError(f"text directory {self.root} is not a directory")
    if not 0.0 < validation_fraction < 1.0:
      raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    files = sorted(p for p in self.root.rglob(pattern)
                   if not EXCLUDED_DIRS.intersection(p.relative_to(self.root).parts)
                   and p.is_file() and p.stat().st_size > 0)
    if not files:
      raise ValueError(f"no text in {self.root}: it holds no non-empty {pattern} file "
                       f"(outside {', '.join(sorted(EXCLUDED_DIRS))})")
    if len(files) < 2:
      raise ValueError(f"{self.root} holds one {pattern} file ({files[0].name}); a "
                       "validation split that does not overlap training needs two or more")
    # A stable hash of the relative path picks the held-out files.
    rank = sorted(files, key=lambda p: (zlib.crc32(str(p.relative_to(self.root)).encode()),
                                        str(p)))
    held_out = set(rank[:max(1, round(validation_fraction * len(files)))])
    self.parts = {"train": _part([f for f in files if f not in held_out]),
                  "validation": _part([f for f in files if f in held_out])}
    self._cache: collections.OrderedDict[pathlib.Path, bytes] = collections.OrderedDict()
    self._cached_files = cached_files

  def __repr__(self) -> str:
    sizes = ", ".join(f"{name} {len(p.files)} files / {p.size:,} bytes"
                      for name, p in self.parts.items())
    return f"ByteCorpus({self.root}: {sizes})"

  def batch(self, part: str, step: int, *, batch: int, length: int, seed: int) -> np.ndarray:
    """``[batch, length]`` uint8: windows of `part` at offsets drawn from
    ``(seed, part, step)``."""
    if part not in self.parts:
      raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    stream = self.parts[part]
    if length > stream.size:
      raise ValueError(f"windows of {length} bytes do not fit the {part} part of "
                       f"{self.root} ({stream.size} bytes)")
    rng = np.random.default_rng([seed, PARTS.index(part), step])
    offsets = rng.integers(0, stream.size - length + 1, size=batch)
    return np.stack([np.frombuffer(self._read(stream, int(o), length), np.uint8)
                     for o in offsets])

  def batches(self, part: str, *, batch: int, length: int, seed: int, start: int = 0):
    """The batches of steps ``start, start + 1, ...``."""
    step = start
    while True:
      yield self.batch(part, step, batch=batch, length=length, seed=seed)
      step += 1

  def _read(self, stream: Part, offset: int, length: int) -> bytes:
    out = []
    i = bisect.bisect_right(stream.starts, offset) - 1
    while length > 0:
      data = self._file(stream.files[i]) + SEPARATOR
      chunk = data[offset - stream.starts[i]:][:length]
      out.append(chunk)
      length -= len(chunk)
      offset += len(chunk)
      i += 1
    return b"".join(out)

  def _file(self, path: pathlib.Path) -> bytes:
    if path in self._cache:
      self._cache.move_to_end(path)
      return self._cache[path]
    data = path.read_bytes()
    self._cache[path] = data
    if len(self._cache) > self._cached_files:
      self._cache.popitem(last=False)
    return data


def _part(files) -> Part:
  starts, size = [], 0
  for f in files:
    starts.append(size)
    size += f.stat().st_size + len(SEPARATOR)
  return Part(tuple(files), tuple(starts), size)
