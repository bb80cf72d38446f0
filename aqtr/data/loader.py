"""Deterministic batches from a seed: token windows and shuffled examples.

Every run of a comparison gets the same batches in the same order when it
passes the same seed; no global random state is read or written.

Example:
  >>> import numpy as np
  >>> from aqtr.data import loader
  >>> tokens = np.arange(100, dtype=np.uint8)
  >>> x, y = next(loader.windows(tokens, batch_size=2, seq_len=4, seed=0))
  >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
  ((2, 4), True)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ['eval_windows', 'examples', 'windows']


def _check(n: int, seq_len: int, what: str) -> None:
  if n < seq_len + 1:
    raise ValueError(
      f'{what} text has {n} tokens, fewer than seq_len + 1 = {seq_len + 1}; '
      'use a shorter seq_len or a larger corpus.'
    )


def windows(
  tokens: np.ndarray, batch_size: int, seq_len: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless random (inputs, next-token targets) windows of `tokens`.

  Args:
    tokens: 1-D token ids.
    batch_size: windows per batch.
    seq_len: window length.
    seed: start positions come from `np.random.default_rng(seed)`.

  Yields:
    (x, y) int32 [batch_size, seq_len] with `y[:, t] == x[:, t + 1]`
    shifted by one token along the text.
  """
  tokens = np.asarray(tokens)
  _check(len(tokens), seq_len, 'training')
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    w = tokens[starts[:, None] + offsets].astype(np.int32)
    yield w[:, :-1], w[:, 1:]


def eval_windows(
  tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
  """A fixed evaluation set: evenly spaced windows over the whole text.

  Example:
    >>> import numpy as np
    >>> b = eval_windows(np.arange(50), 2, 4, num_batches=3)
    >>> len(b), b[0][0].shape
    (3, (2, 4))
  """
  tokens = np.asarray(tokens)
  _check(len(tokens), seq_len, 'validation')
  n = batch_size * num_batches
  starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)
  w = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  w = w.reshape(num_batches, batch_size, seq_len + 1)
  return [(b[:, :-1], b[:, 1:]) for b in w]


def examples(
  x: np.ndarray, y: np.ndarray, batch_size: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless (x, y) batches; each epoch is a fresh permutation from `seed`.

  Batches never straddle epochs; the tail of a permutation shorter than
  `batch_size` is dropped.

  Example:
    >>> import numpy as np
    >>> it = examples(np.arange(10), np.arange(10), 4, seed=1)
    >>> [len(next(it)[0]) for _ in range(3)]
    [4, 4, 4]
  """
  if len(x) != len(y):
    raise ValueError(f'x has {len(x)} examples but y has {len(y)}.')
  if not 0 < batch_size <= len(x):
    raise ValueError(f'batch_size must be in 1..{len(x)}, got {batch_size}.')
  rng = np.random.default_rng(seed)
  while True:
    perm = rng.permutation(len(x))
    for i in range(0, len(x) - batch_size + 1, batch_size):
      idx = perm[i : i + batch_size]
      yield x[idx], y[idx]
