"""The `numerics` registry: the number format a scaled tensor is rounded to.

The base type `Numerics` is the core's (`aqtr.core.algorithms`); this
module holds the registry and helpers for numerics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aqtr.core.algorithms import Numerics
from aqtr.core.registry import Registry

__all__ = [
  'Numerics',
  'get',
  'names',
  'register',
  'registry',
  'within_range',
]

# v = x / (bound / max_value) lands up to a couple of ulps above max_value
# for the element that defines the bound; that element is not clipped.
_CLIP_SLACK = 1.0 + 2.0**-20


def within_range(v: jax.Array, max_value: float) -> jax.Array:
  """The clip-gradient mask `1[|v| <= max_value]`, tolerant to that rounding."""
  return jnp.abs(v) <= max_value * _CLIP_SLACK


registry: Registry = Registry('numerics', Numerics)
register = registry.register
get = registry.get
names = registry.names
