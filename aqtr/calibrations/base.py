"""Calibrations: the bound a scale group's values are mapped onto.

A calibration's `calibrate` reduces a tensor over the axes that share one
scale and returns `bound` with those axes kept (size 1). The quantizer then
sets `s = bound / numerics.max_value` (bound 0 -> s = 1; kept a normal
float32, see `aqtr.core.scale`), optionally rounded up to a power of two.
Contract (checked for every registered calibration, under jit, with NaN or
inf anywhere in a group, and with all-NaN groups): the bound is >= 0, and
non-finite (NaN or inf) wherever its group holds a non-finite value, so
NaN/inf inputs surface in the output instead of being clipped away. Beware:
a jitted `jnp.max` on XLA:CPU may skip NaNs (and return -inf for an all-NaN
group); map NaN to inf first, or add `nonfinite_guard`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr import tags
from aqtr.core.registry import Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration(abc.ABC):
  """Base class of the `calibrations` registry.

  Attributes:
    po2_scale: round the scale up to a power of two, `s <- 2^ceil(log2 s)`.
      Then fake quant and the real integer dot agree bit for bit.
  """

  po2_scale: Annotated[bool, tags.Po2Scale] = False

  def __post_init__(self):
    if not isinstance(self.po2_scale, bool):
      raise TypeError(
        f'{type(self).__name__}.po2_scale must be a bool, got '
        f'{self.po2_scale!r}.'
      )

  @abc.abstractmethod
  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """The bound per scale group: `x` reduced over `axes`, keepdims.

    (Named `calibrate` rather than DESIGN.md's `bound` so that algorithms
    may have a field called `bound`, as `Constant` does.)
    """


def nonfinite_guard(x: jax.Array, axes: Sequence[int]) -> jax.Array:
  """0 per group, NaN where the group holds NaN or inf (add to a bound)."""
  return jnp.sum(jnp.zeros((), x.dtype) * x, axis=tuple(axes), keepdims=True)


registry: Registry = Registry('calibrations', Calibration)
register = registry.register
get = registry.get
names = registry.names
