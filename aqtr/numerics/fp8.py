"""8-bit floating point numerics (e4m3fn, e5m2)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr.core import markers
from aqtr.numerics.base import Numerics, register, within_range

_DTYPES = ('float8_e4m3fn', 'float8_e5m2')


@register('fp8')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8(Numerics):
  """FP8 with saturation (Micikevicius et al. 2022, arXiv 2209.05433).

  Math: `s = bound / finfo(dtype).max`, `q = cast(clip(x/s, -max, max))`
  with round-to-nearest-even. e4m3fn: max 448, no inf; e5m2: max 57344.
  NaN stays NaN. The HFP8 recipe uses e4m3 forward and e5m2 for gradients.

  Attributes:
    dtype_name: 'float8_e4m3fn' or 'float8_e5m2'.
    clip_gradient: zero the gradient of saturated values.

  Example:
    >>> Fp8(dtype_name='float8_e4m3fn').max_value
    448.0
  """

  dtype_name: str = 'float8_e4m3fn'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  def __post_init__(self):
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'Fp8.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )
    if self.dtype_name not in _DTYPES:
      raise ValueError(
        f'Fp8.dtype_name must be one of {_DTYPES}, got {self.dtype_name!r}.'
      )

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype_name)

  @property
  def max_value(self) -> float:
    return float(jnp.finfo(self.dtype).max)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if noise is not None:
      raise ValueError('Fp8 does not support stochastic rounding yet.')
    m = self.max_value
    return jnp.clip(v, -m, m).astype(self.dtype)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
