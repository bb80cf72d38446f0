"""scikit-learn digits: deterministic split, clear error without sklearn."""

import sys

import numpy as np
import pytest

from aqtr.data import digits


def test_load_split():
  pytest.importorskip('sklearn')
  a, b = digits.load(seed=0), digits.load(seed=0)
  np.testing.assert_array_equal(a.x_train, b.x_train)
  assert a.x_train.shape[1] == 64 and a.x_train.dtype == np.float32
  assert len(a.x_train) + len(a.x_val) == 1797
  assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
  assert set(np.unique(a.y_val)) == set(range(10))
  c = digits.load(seed=1)
  assert not np.array_equal(a.y_val, c.y_val)


def test_missing_sklearn_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'sklearn', None)
  with pytest.raises(ImportError, match=r"pip install 'aqtr\[train\]'"):
    digits.load()
