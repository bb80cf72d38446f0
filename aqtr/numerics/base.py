"""Numerics: the number format a scaled tensor is rounded to.

A numerics maps an already scaled float `v = x / s` to stored values `q`
(int8, fp8, ...) such that `x ~ s * unit * q`. It declares the largest
magnitude `max_value` the calibration bound is mapped to, the dtype fed to
the dot and, with `clip_gradient`, a straight-through gradient mask.

Two hooks let a numerics choose its scale: `scale_from_bound` (symmetric
numerics; MX formats round it to a power of two) and, for asymmetric
numerics (`asymmetric = True`), `scale_from_range` and `zero_point`, fed
with the (lo, hi) of a calibration that defines `calibrate_range`
(`minmax`); then `x ~ s * (q - z)`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from aqtr.core.registry import Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics(abc.ABC):
  """Base class of the `numerics` registry.

  Subclasses are frozen kw-only dataclasses; validate in `__post_init__`.
  """

  # False only for the passthrough numerics ('none').
  quantizes: ClassVar[bool] = True
  # Whether `quantize` accepts additive rounding noise (stochastic rounding).
  supports_stochastic_rounding: ClassVar[bool] = False
  # The dot family: 'int' (integer dot, int32 accumulation) or 'float'.
  kind: ClassVar[str] = 'float'
  # Affine numerics with a zero point: `x ~ s * (q - z)`, where s and z come
  # from `scale_from_range` and `zero_point`; the calibration must define
  # `calibrate_range(x, axes) -> (lo, hi)`.
  asymmetric: ClassVar[bool] = False

  @property
  @abc.abstractmethod
  def max_value(self) -> float:
    """The magnitude the calibration bound maps to: `s = bound/max_value`."""

  @property
  def unit(self) -> float:
    """Value of one stored step: `x ~ s * unit * q` (0.5 on half grids)."""
    return 1.0

  @property
  @abc.abstractmethod
  def dtype(self) -> jnp.dtype:
    """The stored dtype of `q`."""

  @property
  def dot_dtype(self) -> jnp.dtype:
    """The dtype `q` is given to the dot in (e.g. int4 is widened to int8)."""
    return self.dtype

  @property
  def block_size(self) -> int | None:
    """Block formats (MX, NVFP4): elements per block along the contraction,
    which the operand's tiling must use (`SubChannel(tile_size=...)`);
    None: any tiling."""
    return None

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    """The scale per group from its calibrated bound (keepdims shape).

    Default: `s = bound / max_value`, and 1 where the bound is too small to
    divide by (an all-zero group). Override to constrain the scale (MX:
    a power of two). The quantizer then applies the calibration's
    `po2_scale` and computes `q = quantize(x / s)`.
    """
    qmax = self.max_value
    tiny = qmax * float(jnp.finfo(jnp.float32).tiny)
    return jnp.where(bound < tiny, jnp.float32(1), bound / qmax)

  @abc.abstractmethod
  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """Rounds the scaled tensor `v` to stored values of `self.dtype`.

    Args:
      v: the scaled float tensor `x / s`.
      noise: uniform noise in [-1/2, 1/2) for stochastic rounding, or None.
    """

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    """Straight-through gradient mask for `v`, or None to pass all."""
    del v
    return None


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
