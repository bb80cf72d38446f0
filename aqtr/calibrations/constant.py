"""Constant (static) calibration."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.calibrations.base import Calibration, nonfinite_guard, register


@register('constant')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Constant(Calibration):
  """bound = the fixed value `bound` for every group (a static range).

  Values beyond the bound are clipped. Non-finite inputs still make their
  group's bound NaN (the registry contract), so they are not hidden.

  Attributes:
    bound: the fixed bound, finite and > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> Constant(bound=3.0).calibrate(jnp.ones((2, 4)), axes=(1,)).tolist()
    [[3.0], [3.0]]
  """

  bound: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    b = self.bound
    if isinstance(b, bool) or not isinstance(b, int | float):
      raise TypeError(f'Constant.bound must be a float, got {b!r}.')
    if not (math.isfinite(b) and b > 0):
      raise ValueError(f'Constant.bound must be finite and > 0, got {b}.')

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    guard = nonfinite_guard(x, axes)
    return jnp.full(guard.shape, self.bound, x.dtype) + guard
