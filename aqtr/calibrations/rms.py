"""Moment calibration: a multiple of the group's p-norm mean (absmean, rms)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.calibrations.base import Calibration, register


@register('rms')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Rms(Calibration):
  """bound = c * (mean_G |x|^p)^(1/p): absmean (p=1) or k-sigma (p=2).

  Math: with `m = max_G |x|` the bound is computed as
  `c * m * (mean_G (|x|/m)^p)^(1/p)` so large values do not overflow
  (`m = 0` gives 0). p=1, c=1 is the absmean scale of BitNet b1.58 (Ma et
  al. 2024, arXiv 2402.17764), `gamma = mean|W|`, used with the `ternary`
  numerics; p=2, c=k is the "k-sigma" clip for zero-mean data. Values
  beyond the bound are clipped (pair with the numerics' clip_gradient).
  Cost: one pass over the group, like absmax.

  Attributes:
    p: the moment, finite and >= 1.
    c: multiplier on the moment, finite and > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1., -3.]])
    >>> Rms(p=1, c=1.0).calibrate(x, axes=(1,)).tolist()
    [[2.0]]
    >>> Rms(p=2, c=2.0).calibrate(x, axes=(1,)).tolist()  # 2 * sqrt(5)
    [[4.4721360206604]]
  """

  p: float = 2.0
  c: float = 3.0

  def __post_init__(self):
    super().__post_init__()
    for name, low, strict in (('p', 1.0, False), ('c', 0.0, True)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f'Rms.{name} must be a float, got {v!r}.')
      ok = math.isfinite(v) and (v > low if strict else v >= low)
      if not ok:
        rel = '>' if strict else '>='
        raise ValueError(
          f'Rms.{name} must be finite and {rel} {low:g}, got {v}.'
        )

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    axes = tuple(axes)
    a = jnp.abs(x)
    m = jnp.max(a, axis=axes, keepdims=True)
    safe = jnp.where(m > 0, m, jnp.ones_like(m))
    r = a / safe
    if self.p == 1:
      moment = jnp.mean(r, axis=axes, keepdims=True)
    elif self.p == 2:
      moment = jnp.sqrt(jnp.mean(r * r, axis=axes, keepdims=True))
    else:
      moment = jnp.mean(r**self.p, axis=axes, keepdims=True) ** (1 / self.p)
    # NaN/inf groups: inf/inf is NaN, so the bound stays non-finite.
    return jnp.where(m > 0, self.c * m * moment, m)
