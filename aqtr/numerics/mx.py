"""OCP Microscaling (MX) block formats: MXFP8, MXFP6, MXFP4, MXINT8."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp

from aqtr.core import markers
from aqtr.numerics.base import Numerics, register, within_range
from aqtr.numerics.fp import Fp

# element name -> (exponent_bits, mantissa_bits) of the OCP element format;
# 'int8' is MXINT8 (two's complement with an implicit scale of 2^-6).
ELEMENTS = {
  'fp8_e4m3': (4, 3),
  'fp8_e5m2': (5, 2),
  'fp6_e2m3': (2, 3),
  'fp6_e3m2': (3, 2),
  'fp4_e2m1': (2, 1),
  'int8': None,
}
_INT8_UNIT = 2.0**-6


def po2_scale(bound: jax.Array, emax: int) -> jax.Array:
  """The E8M0 shared scale `2^(floor(log2 bound) - emax)` (bound 0 -> 1).

  The exponent is clamped to E8M0's range [-127, 127]; a NaN / inf bound
  gives a NaN scale (so the group's output is NaN, not clipped).

  Example:
    >>> import jax.numpy as jnp
    >>> po2_scale(jnp.array([1000.0, 0.0]), emax=8).tolist()
    [2.0, 1.0]
  """
  _, e = jnp.frexp(bound)  # bound = f 2^e, f in [1/2, 1): floor(log2) = e-1
  e = jnp.clip(e - 1 - emax, -127, 127)
  s = jnp.ldexp(jnp.ones_like(bound), e)
  s = jnp.where(bound > 0, s, jnp.float32(1))
  return jnp.where(jnp.isfinite(bound), s, jnp.float32(jnp.nan))


@register('mx')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mx(Numerics):
  """OCP Microscaling: 32-element blocks sharing one power-of-two scale.

  Math (OCP Microscaling Formats (MX) v1.0, 2023; Rouhani et al. 2023,
  arXiv 2310.10537). Per block of 32 consecutive elements along the
  contraction axis, `X = 2^(floor(log2 amax) - emax_elem)` where amax is the
  block's absolute maximum (the calibration's bound) and emax_elem the
  exponent of the element format's largest normal (e4m3 8, e5m2 15, e2m3 2,
  e3m2 4, e2m1 2, int8 0); the elements `x / X` are rounded to the element
  format (nearest even; values above its max normal are clamped). X is an
  E8M0 value (a power of two in [2^-127, 2^127], exact in
  float8_e8m0fnu); the QTensor keeps it as float32. MXINT8 elements are
  int8 times 2^-6 (|q| <= 127, the symmetric range).

  The blocks are the engine's sub-channel tiles: a TensorConfig with Mx
  must use `SubChannel(tile_size=32)` (validated), so the scale factors
  out of each tile's dot, and the contraction must be a multiple of 32.
  MXFP8 and MXINT8 run fp8 / int8 dots; XLA:CPU has no fp6 / fp4 dot, so
  those elements are stored in float8_e4m3fn (exactly) and the dot runs in
  fp8.

  Attributes:
    element: one of ELEMENTS.
    clip_gradient: zero the gradient of clamped values.

  Example:
    >>> Mx(element='fp4_e2m1').max_value, Mx(element='fp4_e2m1').emax
    (6.0, 2)
  """

  element: str = 'fp8_e4m3'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  BLOCK_SIZE: ClassVar[int] = 32

  def __post_init__(self):
    if self.element not in ELEMENTS:
      raise ValueError(
        f'Mx.element must be one of {tuple(ELEMENTS)}, got {self.element!r}.'
      )
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'Mx.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )

  @property
  def block_size(self) -> int:
    """Elements per block along the contraction axis (the tile size)."""
    return self.BLOCK_SIZE

  @property
  def kind(self) -> str:  # type: ignore[override]
    return 'int' if self.element == 'int8' else 'float'

  @property
  def fp(self) -> Fp | None:
    """The element format as an `Fp` (None for int8)."""
    em = ELEMENTS[self.element]
    return None if em is None else Fp(exponent_bits=em[0], mantissa_bits=em[1])

  @property
  def max_value(self) -> float:
    return 127 * _INT8_UNIT if self.fp is None else self.fp.max_value

  @property
  def emax(self) -> int:
    """Exponent of the element format's largest normal value."""
    return math.frexp(self.max_value)[1] - 1

  @property
  def unit(self) -> float:
    return _INT8_UNIT if self.fp is None else 1.0

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.int8) if self.fp is None else self.fp.dtype

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    return po2_scale(bound, self.emax)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if noise is not None:
      raise ValueError('Mx does not support stochastic rounding.')
    if self.fp is None:
      q = jnp.clip(jnp.round(v / _INT8_UNIT), -127, 127)
      return q.astype(jnp.int8)
    return self.fp.quantize(v)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
