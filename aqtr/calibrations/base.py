"""The `calibrations` registry: the bound a scale group's values map onto.

The base type `Calibration` is the core's (`aqtr.core.algorithms`); this
module holds the registry and helpers for calibrations.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.core.algorithms import Calibration, StatefulCalibration, group_shape
from aqtr.core.registry import Registry

__all__ = [
  'Calibration',
  'StatefulCalibration',
  'get',
  'group_shape',
  'learned_magnitude',
  'names',
  'nonfinite_guard',
  'register',
  'registry',
]


def nonfinite_guard(x: jax.Array, axes: Sequence[int]) -> jax.Array:
  """0 per group, NaN where the group holds NaN or inf (add to a bound)."""
  return jnp.sum(jnp.zeros((), x.dtype) * x, axis=tuple(axes), keepdims=True)


# The smallest normal float32, the floor of a learned step or clip.
TINY = float(jnp.finfo(jnp.float32).tiny)


def learned_magnitude(p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max(|p|, 2^-126), sign): a learned step or clip as used, and the
  factor that turns d/d|p| into d/dp.

  A learned step or clip p enters the bound as its magnitude, floored at
  the smallest normal float32 (so p = 0 quantizes like a tiny p, to ~0,
  never like the all-zero group's s = 1). Its gradient is that of the
  used magnitude times sign(p), with sign(0) = +1: an optimizer moves |p|
  the right way from either sign and off 0.

  Example:
    >>> import jax.numpy as jnp
    >>> m, d = learned_magnitude(jnp.array([-2.0, 0.0, 3.0]))
    >>> d.tolist(), bool(m[1] > 0)
    ([-1.0, 1.0, 1.0], True)
  """
  mag = jnp.abs(p)
  mag = jnp.where(mag < TINY, jnp.float32(TINY), mag)
  return mag, jnp.where(p < 0, jnp.float32(-1), jnp.float32(1))


registry: Registry = Registry('calibrations', Calibration)
register = registry.register
get = registry.get
names = registry.names
