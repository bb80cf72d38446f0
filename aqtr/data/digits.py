"""scikit-learn's bundled 8x8 handwritten digits, split deterministically.

`load_digits` ships inside scikit-learn (no download). scikit-learn is an
optional dependency (`pip install 'aqtr[train]'`); without it `load` raises
an ImportError that says so.

Example:
  >>> from aqtr.data import digits
  >>> d = digits.load()
  >>> d.x_train.shape[1], d.num_classes, len(d.x_train) + len(d.x_val)
  (64, 10, 1797)
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ['Digits', 'load']


@dataclasses.dataclass(frozen=True)
class Digits:
  """Images as float32 [N, 64] in [0, 1], labels int32 [N]."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_val: np.ndarray
  y_val: np.ndarray
  num_classes: int = 10


def _sklearn_digits():
  try:
    from sklearn import datasets
  except ImportError as e:
    raise ImportError(
      'the digits task needs scikit-learn (it bundles the data set): '
      "pip install 'aqtr[train]'  (or: pip install scikit-learn)"
    ) from e
  return datasets.load_digits()


def load(val_fraction: float = 0.2, seed: int = 0) -> Digits:
  """The 1797 digits, shuffled once by `seed` and split train/validation.

  Args:
    val_fraction: share held out for validation, in (0, 1).
    seed: the permutation's seed (the same seed gives the same split).

  Returns:
    A Digits with disjoint train and validation examples.

  Raises:
    ImportError: scikit-learn is not installed (message says how to fix).
  """
  if not 0 < val_fraction < 1:
    raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}.')
  raw = _sklearn_digits()
  x = np.asarray(raw.data, np.float32) / 16.0
  y = np.asarray(raw.target, np.int32)
  perm = np.random.default_rng(seed).permutation(len(x))
  n_val = max(1, int(round(len(x) * val_fraction)))
  va, tr = perm[:n_val], perm[n_val:]
  return Digits(x[tr], y[tr], x[va], y[va])
