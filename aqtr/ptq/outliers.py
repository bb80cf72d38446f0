"""Activation outliers injected by an exactly equivalent rescaling.

Trained LLMs have a few input channels of each norm's output with values
tens of times larger than the rest (Dettmers et al. 2022, arXiv
2208.07339; SmoothQuant, arXiv 2211.10438): per-tensor int8 activations
then lose the other channels to rounding. A small model trained briefly
has none. `inject` makes them without changing the float model: for each
norm fold group it multiplies a few channels of the norm's scale (and
bias) by a factor f and divides the matching input rows of every consumer
weight by f (`fold.apply` with s = 1 / f). The factors are powers of two
(32 and 64 by default), so both products are exact in binary floating
point and the float model's outputs are unchanged bit for bit.

Example:
  >>> import jax.numpy as jnp
  >>> from aqtr.ptq import fold
  >>> p = {'n': {'scale': jnp.ones(8)}, 'w': {'kernel': jnp.ones((8, 2))}}
  >>> m = fold.FoldMap(groups=(fold.FoldGroup(name='n',
  ...   sources=(fold.Axis(path='n/scale'),),
  ...   consumers=(fold.Axis(path='w/kernel'),)),))
  >>> q, where = inject(p, m, channels=2, factors=(64.0,))
  >>> float(q['n']['scale'].max()), float(q['w']['kernel'].min())
  (64.0, 0.015625)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from aqtr.ptq import fold

__all__ = ['inject']


def inject(
  params: Mapping,
  fold_map: fold.FoldMap,
  *,
  channels: int = 4,
  factors: Sequence[float] = (32.0, 64.0),
  seed: int = 0,
) -> tuple[dict, dict[str, tuple[list[int], list[float]]]]:
  """Multiplies `channels` channels of each norm group's output by a factor.

  Args:
    params: the float parameters.
    fold_map: the model's fold map; its 'norm' groups get outliers.
    channels: channels per group (distinct, drawn at random).
    factors: the factors, drawn per channel; powers of two keep the float
      model's outputs bit for bit (others only to float rounding).
    seed: the draw's seed.

  Returns:
    (new params, {group name: (channel indices, factors)}).

  Raises:
    ValueError: `channels` < 1 or more than a group has, or a factor that
      is not a positive finite number.
  """
  bad = not isinstance(channels, int) or isinstance(channels, bool)
  if bad or channels < 1:
    raise ValueError(
      f'outliers.inject: channels must be an int >= 1, got {channels!r}.'
    )
  factors = tuple(factors)
  if not factors or not all(
    isinstance(f, int | float) and math.isfinite(f) and f > 0 for f in factors
  ):
    raise ValueError(
      f'outliers.inject: factors must be positive finite numbers, got '
      f'{factors!r}.'
    )
  sizes = fold.check(params, fold_map)
  rng = np.random.default_rng(seed)
  where = {}
  out = dict(params)
  for g in fold_map.groups:
    if g.kind != 'norm':
      continue
    n = sizes[g.name]
    if channels > n:
      raise ValueError(
        f'outliers.inject: channels={channels} exceeds the {n} channels of '
        f'group {g.name!r}.'
      )
    idx = sorted(rng.choice(n, channels, replace=False).tolist())
    f = [float(rng.choice(factors)) for _ in idx]
    s = np.ones((n,), np.float32)
    s[idx] = 1.0 / np.asarray(f, np.float32)
    out = fold.apply(out, g, jnp.asarray(s))
    where[g.name] = (idx, f)
  return out, where
