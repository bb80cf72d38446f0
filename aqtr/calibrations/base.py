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
  'names',
  'nonfinite_guard',
  'register',
  'registry',
]


def nonfinite_guard(x: jax.Array, axes: Sequence[int]) -> jax.Array:
  """0 per group, NaN where the group holds NaN or inf (add to a bound)."""
  return jnp.sum(jnp.zeros((), x.dtype) * x, axis=tuple(axes), keepdims=True)


registry: Registry = Registry('calibrations', Calibration)
register = registry.register
get = registry.get
names = registry.names
