"""examples/stdlib_bytes.py: the byte loader of the example.

On small directories made here (each file one repeated letter, so that every
window says which files it came from) and on the standard library itself.
"""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from stdlib_bytes import SEPARATOR, ByteCorpus, stdlib_dir  # noqa: E402

LETTERS = "abcdefghijklmnopqrst"


@pytest.fixture
def corpus_dir(tmp_path):
  """20 files of 50 to 240 bytes, file i all LETTERS[i], one in a subfolder;
  and files the loader must skip."""
  for i, letter in enumerate(LETTERS):
    folder = tmp_path / ("pkg" if i == 3 else "")
    folder.mkdir(exist_ok=True)
    (folder / f"mod_{letter}.py").write_text(letter * (50 + 10 * i))
  (tmp_path / "notes.txt").write_text("Z" * 100)
  (tmp_path / "site-packages").mkdir()
  (tmp_path / "site-packages" / "third.py").write_text("Y" * 100)
  (tmp_path / "empty.py").write_text("")
  return tmp_path


def letters(windows) -> set:
  return set(bytes(np.asarray(windows).ravel()).decode()) - {SEPARATOR.decode()}


def test_split_by_file_does_not_overlap(corpus_dir):
  corpus = ByteCorpus(corpus_dir, validation_fraction=0.2)
  train, val = corpus.parts["train"], corpus.parts["validation"]
  assert len(val.files) == 4 and len(train.files) == 16
  assert not set(train.files) & set(val.files)
  assert {f.name for f in train.files + val.files} == {f"mod_{c}.py" for c in LETTERS}
  seen = {part: set() for part in corpus.parts}
  for part in corpus.parts:
    for step in range(50):
      seen[part] |= letters(corpus.batch(part, step, batch=4, length=30, seed=0))
  # Every letter of a part shows up, and none of the other part's.
  assert seen["train"] == {f.stem[-1] for f in train.files}
  assert seen["validation"] == {f.stem[-1] for f in val.files}


def test_the_split_does_not_depend_on_the_seed_or_the_order_of_listing(corpus_dir):
  a = ByteCorpus(corpus_dir, validation_fraction=0.2)
  b = ByteCorpus(corpus_dir, validation_fraction=0.2)
  assert a.parts == b.parts


def test_batches_are_deterministic_for_a_seed(corpus_dir):
  corpus, again = ByteCorpus(corpus_dir), ByteCorpus(corpus_dir)
  first = corpus.batch("train", 7, batch=3, length=40, seed=1)
  assert first.shape == (3, 40) and first.dtype == np.uint8
  # Token bytes (integers): exact.
  np.testing.assert_array_equal(first, again.batch("train", 7, batch=3, length=40, seed=1))
  assert not np.array_equal(first, corpus.batch("train", 7, batch=3, length=40, seed=2))
  assert not np.array_equal(first, corpus.batch("train", 8, batch=3, length=40, seed=1))
  # The stream of batches resumes at any step.
  stream = corpus.batches("train", batch=3, length=40, seed=1, start=5)
  next(stream)
  np.testing.assert_array_equal(next(stream), again.batch("train", 6, batch=3, length=40,
                                                          seed=1))


def test_windows_are_consecutive_bytes_of_the_stream(corpus_dir):
  corpus = ByteCorpus(corpus_dir)
  part = corpus.parts["train"]
  stream = b"".join(f.read_bytes() + SEPARATOR for f in part.files)
  assert len(stream) == part.size
  windows = corpus.batch("train", 0, batch=64, length=part.size // 2, seed=0)
  for w in windows:  # windows cross file boundaries as the stream does
    assert bytes(w) in stream


@pytest.mark.parametrize("make, error, match", [
    (lambda d: d / "missing", FileNotFoundError, r"text directory .*missing does not exist"),
    (lambda d: d, ValueError, r"no text in .*: it holds no non-empty \*\.py file"),
    (lambda d: (d / "a.py").write_text("x = 1\n") and d, ValueError,
     r"holds one \*\.py file \(a\.py\); a validation split .* needs two or more"),
    (lambda d: (d / "f").write_text("x") and d / "f", NotADirectoryError, r"not a directory"),
])
def test_clear_errors(tmp_path, make, error, match):
  (tmp_path / "only_empty.py").write_text("")
  (tmp_path / "readme.txt").write_text("not python")
  with pytest.raises(error, match=match):
    ByteCorpus(make(tmp_path))


def test_windows_longer_than_a_part(corpus_dir):
  corpus = ByteCorpus(corpus_dir)
  with pytest.raises(ValueError, match=r"windows of 100000 bytes do not fit the validation"):
    corpus.batch("validation", 0, batch=1, length=100_000, seed=0)
  with pytest.raises(ValueError, match=r"part must be one of"):
    corpus.batch("test", 0, batch=1, length=10, seed=0)


def test_the_standard_library():
  corpus = ByteCorpus()
  assert corpus.root == stdlib_dir()
  train, val = corpus.parts["train"], corpus.parts["validation"]
  assert len(train.files) > 100 and 0 < len(val.files) < len(train.files) / 10
  assert not any("site-packages" in f.parts for f in train.files + val.files)
  text = bytes(corpus.batch("train", 0, batch=8, length=256, seed=0).ravel())
  assert b"def " in text or b"import" in text or b"self" in text
