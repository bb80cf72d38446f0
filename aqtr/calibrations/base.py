"""Calibrations: the bound a scale group's values are mapped onto.

A calibration's `calibrate` reduces a tensor over the axes that share one
scale and returns
`bound` with those axes kept (size 1). The quantizer then sets
`s = bound / numerics.max_value` (bound 0 -> s = 1), optionally rounded up to
a power of two. Contract (checked for every registered calibration): the
bound is >= 0, and non-finite wherever its group holds a non-finite value, so
NaN/inf inputs surface in the output instead of being clipped away.
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

  def bound_for(self, x: jax.Array, axes: Sequence[int], numerics) -> jax.Array:
    """The bound for quantizing `x` with `numerics` (the quantizer's call).

    Defaults to `calibrate(x, axes)`; a calibration that searches over the
    quantization error (e.g. `Mse`) overrides it to see the numerics.
    (Named `bound_for`, not `bound`, for the same reason as `calibrate`.)

    Args:
      x: float tensor.
      axes: the axes sharing one scale.
      numerics: the operand's `aqtr.numerics.Numerics`.
    """
    del numerics
    return self.calibrate(x, axes)


def nonfinite_guard(x: jax.Array, axes: Sequence[int]) -> jax.Array:
  """0 per group, NaN where the group holds NaN or inf (add to a bound)."""
  return jnp.sum(jnp.zeros((), x.dtype) * x, axis=tuple(axes), keepdims=True)


registry: Registry = Registry('calibrations', Calibration)
register = registry.register
get = registry.get
names = registry.names
