"""Deterministic batching from a seed."""

import itertools

import numpy as np
import pytest

from aqtr.data import loader

TOKENS = (np.arange(1000) % 251).astype(np.uint8)


def _take(it, n):
  return list(itertools.islice(it, n))


def test_windows_same_seed_same_batches():
  a = _take(loader.windows(TOKENS, 4, 16, seed=3), 5)
  b = _take(loader.windows(TOKENS, 4, 16, seed=3), 5)
  c = _take(loader.windows(TOKENS, 4, 16, seed=4), 5)
  for (xa, ya), (xb, yb) in zip(a, b, strict=True):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
  assert any(
    not np.array_equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True)
  )


def test_windows_targets_are_next_tokens():
  x, y = next(loader.windows(TOKENS, 8, 32, seed=0))
  assert x.shape == y.shape == (8, 32) and x.dtype == np.int32
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  np.testing.assert_array_equal((x + 1) % 251, y)  # TOKENS counts up.


def test_eval_windows_fixed_and_cover_text():
  a = loader.eval_windows(TOKENS, 2, 8, num_batches=3)
  b = loader.eval_windows(TOKENS, 2, 8, num_batches=3)
  assert len(a) == 3
  for (xa, ya), (xb, yb) in zip(a, b, strict=True):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
  assert a[0][0][0, 0] == TOKENS[0]
  assert a[-1][1][-1, -1] == TOKENS[-1]


def test_examples_epochs_are_permutations():
  x, y = np.arange(10), np.arange(10) * 2
  it = loader.examples(x, y, 5, seed=0)
  epoch = np.concatenate([next(it)[0] for _ in range(2)])
  assert sorted(epoch) == list(range(10))
  bx, by = next(loader.examples(x, y, 5, seed=0))
  np.testing.assert_array_equal(by, bx * 2)
  np.testing.assert_array_equal(bx, next(loader.examples(x, y, 5, seed=0))[0])


def test_errors():
  with pytest.raises(ValueError, match='seq_len'):
    next(loader.windows(TOKENS[:5], 1, 8, seed=0))
  with pytest.raises(ValueError, match='batch_size'):
    next(loader.examples(np.arange(3), np.arange(3), 4, seed=0))
