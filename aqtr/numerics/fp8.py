"""8-bit floating point numerics (e4m3fn, e5m2 and the fnuz variants)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr.core import markers, prims
from aqtr.numerics.base import Numerics, register, within_range
from aqtr.numerics.fp import FloatGrid

DTYPES = (
  'float8_e4m3fn',
  'float8_e5m2',
  'float8_e4m3fnuz',
  'float8_e5m2fnuz',
)


@register('fp8')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8(Numerics):
  """FP8 with saturation (Micikevicius et al. 2022, arXiv 2209.05433).

  Math: `s = bound / finfo(dtype).max`, `q = cast(clip(x/s, -max, max))`
  with round-to-nearest-even. e4m3fn: max 448, no inf; e5m2: max 57344.
  NaN stays NaN. The HFP8 recipe uses e4m3 forward and e5m2 for gradients.

  The fnuz variants (AMD MI300; MaxText's `nanoo_fp8`) have an exponent
  bias one higher than OCP, one NaN (the -0 code) and no -0:
  float8_e4m3fnuz max 240, float8_e5m2fnuz max 57344.

  Stochastic rounding (with `aqtr.Stochastic()` as the operand's rounding):
  uniform random bits are added below the kept mantissa of the float32
  value, which is then truncated (`FloatGrid.round`): `E[q] = x/s` inside
  the range, saturating at the max.

  Attributes:
    dtype_name: one of DTYPES.
    clip_gradient: zero the gradient of saturated values.

  Example:
    >>> Fp8(dtype_name='float8_e4m3fn').max_value
    448.0
  """

  dtype_name: str = 'float8_e4m3fn'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  supports_stochastic_rounding = True

  def __post_init__(self):
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'Fp8.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )
    if self.dtype_name not in DTYPES:
      raise ValueError(
        f'Fp8.dtype_name must be one of {DTYPES}, got {self.dtype_name!r}.'
      )

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype_name)

  @property
  def max_value(self) -> float:
    return float(jnp.finfo(self.dtype).max)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if noise is not None:
      return FloatGrid.of_dtype(self.dtype).round(v, noise).astype(self.dtype)
    m = self.max_value
    return prims.clip(v, -m, m).astype(self.dtype)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
