"""The stdlib corpus: deterministic files, split by file, no leakage."""

import pathlib

import numpy as np
import pytest

from aqtr.data import stdlib

MAX = 300_000


@pytest.fixture(scope='module')
def corpus():
  return stdlib.load(max_bytes=MAX)


def test_files_sorted_and_filtered():
  names = stdlib.files()
  assert names == sorted(names) == stdlib.files()
  assert 'os.py' in names and 'json/__init__.py' in names
  for n in names:
    parts = set(pathlib.PurePosixPath(n).parts[:-1])
    assert not parts & set(stdlib.EXCLUDE), n


def test_split_by_file_is_disjoint_stable_and_nonempty():
  names = stdlib.files()
  train, val = stdlib.split(names, 10)
  assert not set(train) & set(val)
  assert sorted(train + val) == names
  assert 0.03 < len(val) / len(names) < 0.2
  # A file's side does not depend on the other files (hash of its name).
  sub_train, sub_val = stdlib.split(names[::3], 10)
  assert set(sub_val) <= set(val) and set(sub_train) <= set(train)


def test_load_is_deterministic(corpus):
  again = stdlib.load(max_bytes=MAX)
  np.testing.assert_array_equal(corpus.train, again.train)
  np.testing.assert_array_equal(corpus.val, again.val)
  assert corpus.train_files == again.train_files


def _encoded(names):
  root = stdlib.root()
  return b''.join(
    (root / n).read_bytes().replace(b'\0', b'') + b'\0' for n in names
  )


def test_no_validation_text_in_training(corpus):
  assert not set(corpus.train_files) & set(corpus.val_files)
  # Training bytes are exactly the training files, the last one cut at
  # the cap and closed by a separator.
  full, got = _encoded(corpus.train_files), corpus.train.tobytes()
  assert len(got) == MAX and got[-1] == stdlib.SEPARATOR
  assert got[:-1] == full[: MAX - 1]
  full_val, got_val = _encoded(corpus.val_files), corpus.val.tobytes()
  assert got_val[:-1] == full_val[: len(got_val) - 1]
  for name in corpus.val_files:
    assert stdlib.is_validation(name, 10)


def test_vocab_and_decode(corpus):
  assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
  text = stdlib.decode(corpus.train[:200])
  assert text.startswith(
    (stdlib.root() / corpus.train_files[0]).read_text()[:50]
  )


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match='val_percent'):
    stdlib.split(['a.py'], 0)
  with pytest.raises(FileNotFoundError, match='no .py files'):
    stdlib.files(tmp_path)
