"""Asymmetric (affine) integer numerics with a zero point."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers
from aqtr.numerics.base import Numerics, register

_STORAGE = ('int8', 'uint8')
_TINY = float(jnp.finfo(jnp.float32).tiny)


@register('int_asymmetric')
@dataclasses.dataclass(frozen=True, kw_only=True)
class IntAsymmetric(Numerics):
  """Affine integers: `x ~ s (q - z)` with a zero point z per scale group.

  Math (Jacob et al. 2018, arXiv 1712.05877; TFLite / PyTorch affine
  quantization), from the calibration's range (`minmax`):
    lo = min(min_G x, 0),  hi = max(max_G x, 0),  s = (hi - lo) / (2^b - 1)
    z = round(-lo / s) + qmin,  q = clip(round(x / s) + z, qmin, qmax)
  with [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1] (int8 storage) or
  [0, 2^b - 1] (uint8). 0 is exact (q = z). An all-zero group gets s = 1.
  In a dot the zero points give correction terms,
    sum_k (qa - za)(qb - zb) = qa.qb - zb sum_k qa - za sum_k qb + K za zb,
  so the forward runs the real int8 x int8 -> int32 dot (uint8 values are
  shifted by -128 into int8 first; the difference q - z is unchanged).
  Stochastic rounding adds `u ~ U[-1/2, 1/2)` to `x/s + z` before rounding.

  Attributes:
    bits: 2..8.
    storage: 'int8' (signed range) or 'uint8' (unsigned range).
    clip_gradient: zero the gradient of values outside [qmin, qmax].

  Example:
    >>> n = IntAsymmetric(bits=8, storage='uint8')
    >>> n.qmin, n.qmax
    (0, 255)
  """

  bits: Annotated[int, markers.Bits] = 8
  storage: str = 'int8'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  supports_stochastic_rounding = True
  kind = 'int'
  asymmetric = True

  def __post_init__(self):
    b = self.bits
    if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 8:
      raise ValueError(f'IntAsymmetric.bits must be an int in 2..8, got {b!r}.')
    if self.storage not in _STORAGE:
      raise ValueError(
        f'IntAsymmetric.storage must be one of {_STORAGE}, got '
        f'{self.storage!r}.'
      )
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'IntAsymmetric.clip_gradient must be a bool, got '
        f'{self.clip_gradient!r}.'
      )

  @property
  def qmin(self) -> int:
    return 0 if self.storage == 'uint8' else -(2 ** (self.bits - 1))

  @property
  def qmax(self) -> int:
    return self.qmin + 2**self.bits - 1

  @property
  def max_value(self) -> float:
    """The largest stored magnitude, max(|qmin|, |qmax|)."""
    return float(max(-self.qmin, self.qmax))

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.storage)

  def codec(self) -> codecs.Codec:
    """4-bit codes two per byte for bits <= 4."""
    if self.bits > 4:
      return codecs.Raw()
    return codecs.UInt4() if self.storage == 'uint8' else codecs.Int4()

  @property
  def dot_dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.int8)

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    raise TypeError(
      'IntAsymmetric takes lo/hi bounds (scale_from_range), not a symmetric '
      'bound; use a range calibration such as minmax.'
    )

  def scale_from_range(self, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """`s = (hi - lo) / (2^b - 1)`; 1 where the range is (near) empty."""
    steps = 2.0**self.bits - 1
    width = hi - lo
    return jnp.where(width < steps * _TINY, jnp.float32(1), width / steps)

  def zero_point(self, lo: jax.Array, s: jax.Array) -> jax.Array:
    """`z = round(-lo / s) + qmin`, clipped to [qmin, qmax] (float32)."""
    z = jnp.round(-lo / s) + self.qmin
    return jnp.clip(z, self.qmin, self.qmax)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """Rounds `v = x/s + z` to [qmin, qmax]."""
    if noise is not None:
      v = v + noise
    return jnp.clip(jnp.round(v), self.qmin, self.qmax).astype(self.dtype)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return (v >= self.qmin - 0.5) & (v <= self.qmax + 0.5)
