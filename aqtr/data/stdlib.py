"""A character-level corpus read from the Python standard library's sources.

Every Python installation carries its standard library as `.py` text, so
this corpus needs no download. Files are listed deterministically (sorted
relative paths under `sysconfig.get_paths()['stdlib']`), split into train
and validation BY FILE with a stable hash of the relative path (adding or
removing a file never moves another one across the split), and encoded as
bytes: the vocabulary is the 256 byte values, with byte 0 (absent from
source text) separating files.

Example:
  >>> from aqtr.data import stdlib
  >>> corpus = stdlib.load(max_bytes=100_000)
  >>> corpus.vocab_size, corpus.train.dtype.name
  (256, 'uint8')
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sysconfig
import zlib

import numpy as np

__all__ = ['VOCAB_SIZE', 'Corpus', 'decode', 'files', 'load', 'split']

VOCAB_SIZE = 256
SEPARATOR = 0  # The byte between two files; never occurs in source text.
# Folders that are not the standard library proper (installed packages) or
# that are mostly data, generated code or deliberately broken test inputs.
EXCLUDE = (
  'site-packages',
  'dist-packages',
  '__pycache__',
  'test',
  'tests',
  'idlelib',
  'turtledemo',
  'lib2to3',
  'encodings',
)


def root() -> pathlib.Path:
  """The standard library folder of the running interpreter."""
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def files(
  path: str | pathlib.Path | None = None, exclude: tuple[str, ...] = EXCLUDE
) -> list[str]:
  """Sorted relative paths of the `.py` files under `path` (the stdlib).

  Args:
    path: folder to scan; default: the standard library.
    exclude: folder names skipped at any depth.

  Returns:
    Relative POSIX paths, sorted, e.g. `['__future__.py', ..., 'json/x.py']`.

  Example:
    >>> 'os.py' in files()
    True
  """
  base = pathlib.Path(path) if path is not None else root()
  out = _scan(str(base), tuple(exclude))
  if not out:
    raise FileNotFoundError(
      f'no .py files under {base}; is the Python standard library installed '
      'as source (some minimal images ship only .pyc)?'
    )
  return list(out)


@functools.lru_cache(maxsize=8)
def _scan(base: str, exclude: tuple[str, ...]) -> tuple[str, ...]:
  out = []
  for folder, dirs, names in os.walk(base):
    dirs[:] = [d for d in dirs if d not in exclude]  # Prune, don't descend.
    rel = pathlib.Path(folder).relative_to(base)
    out += [(rel / n).as_posix() for n in names if n.endswith('.py')]
  return tuple(sorted(out))


def is_validation(name: str, val_percent: int) -> bool:
  """Whether file `name` belongs to validation (stable crc32 hash split)."""
  return zlib.crc32(name.encode()) % 100 < val_percent


def split(names: list[str], val_percent: int = 10):
  """(train, validation) file lists; each keeps the sorted order.

  Example:
    >>> split(['a.py', 'b.py', 'c.py'], 50)
    (['c.py'], ['a.py', 'b.py'])
  """
  if not 0 < val_percent < 100:
    raise ValueError(f'val_percent must be in 1..99, got {val_percent}.')
  val = [n for n in names if is_validation(n, val_percent)]
  train = [n for n in names if not is_validation(n, val_percent)]
  if not val or not train:
    raise ValueError(
      f'split of {len(names)} files at {val_percent}% left a side empty.'
    )
  return train, val


def _read(base: pathlib.Path, names: list[str], max_bytes: int | None):
  parts, total = [], 0
  for name in names:
    data = (base / name).read_bytes().replace(b'\0', b'')
    if max_bytes is not None and total + len(data) + 1 > max_bytes:
      data = data[: max(max_bytes - total - 1, 0)]
    parts.append(data + bytes([SEPARATOR]))
    total += len(parts[-1])
    if max_bytes is not None and total >= max_bytes:
      break
  return np.frombuffer(b''.join(parts), dtype=np.uint8), names[: len(parts)]


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Encoded train and validation text (uint8 byte ids) and their files."""

  train: np.ndarray
  val: np.ndarray
  train_files: tuple[str, ...]
  val_files: tuple[str, ...]
  vocab_size: int = VOCAB_SIZE


def load(
  val_percent: int = 10,
  max_bytes: int | None = 4_000_000,
  path: str | pathlib.Path | None = None,
  exclude: tuple[str, ...] = EXCLUDE,
) -> Corpus:
  """Reads, splits by file and encodes the standard library sources.

  Args:
    val_percent: share of files (by stable hash) held out for validation.
    max_bytes: cap on the train text (validation gets a tenth of it plus
      one file at least); files are read in sorted order until the cap.
      None reads everything (~10 MB on CPython 3.11).
    path: corpus folder; default: the standard library.
    exclude: folder names skipped at any depth (`files`).

  Returns:
    A Corpus whose `train` holds no byte of any validation file.

  Example:
    >>> c = load(max_bytes=50_000)
    >>> set(c.train_files) & set(c.val_files)
    set()
  """
  base = pathlib.Path(path) if path is not None else root()
  train, val = split(files(base, tuple(exclude)), val_percent)
  val_max = None if max_bytes is None else max(max_bytes // 10, 1)
  tr, tr_names = _read(base, train, max_bytes)
  va, va_names = _read(base, val, val_max)
  return Corpus(tr, va, tuple(tr_names), tuple(va_names))


def decode(ids) -> str:
  """Byte ids back to text (separators shown as a form feed).

  Example:
    >>> decode([104, 105, 0])
    'hi\\x0c'
  """
  data = bytes(int(i) for i in np.asarray(ids).ravel())
  return data.replace(bytes([SEPARATOR]), b'\f').decode('utf-8', 'replace')
