"""Emulated small floats eXmY (fp4, fp6, fp8, ...) with subnormals."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import jax
import jax.numpy as jnp
import ml_dtypes

from aqtr.core import codecs, markers, prims
from aqtr.numerics.base import Numerics, register, within_range

ENCODINGS = ('auto', 'ieee', 'fn', 'finite', 'fnuz')

# (exponent_bits, mantissa_bits, encoding) -> an ml_dtypes type the dot
# takes as it is; other formats are stored in the first container of
# _CONTAINERS that holds every value exactly.
_NATIVE = {
  (4, 3, 'fn'): 'float8_e4m3fn',
  (5, 2, 'ieee'): 'float8_e5m2',
  (4, 3, 'fnuz'): 'float8_e4m3fnuz',
  (5, 2, 'fnuz'): 'float8_e5m2fnuz',
}
_CONTAINERS = ('float8_e4m3fn', 'float8_e5m2', 'float16', 'float32')


@dataclasses.dataclass(frozen=True)
class FloatGrid:
  """The values of a float format: sign, `mantissa_bits`, min exponent, max.

  Normal values are `(1 + f/2^m) 2^e` for `min_exponent <= e`, subnormals
  `(f/2^m) 2^min_exponent`, all magnitudes capped at `max_value`.
  """

  mantissa_bits: int
  min_exponent: int
  max_value: float

  @classmethod
  def of_dtype(cls, dtype) -> FloatGrid:
    """The grid of an ml_dtypes / numpy float dtype."""
    fi = ml_dtypes.finfo(dtype)
    return cls(int(fi.nmant), int(fi.minexp), float(fi.max))

  def holds(self, other: FloatGrid) -> bool:
    """Whether every value of `other` is a value of this grid."""
    return (
      other.mantissa_bits <= self.mantissa_bits
      and other.min_exponent - other.mantissa_bits
      >= self.min_exponent - self.mantissa_bits
      and other.max_value <= self.max_value
    )

  def round(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """Rounds float32 `v` onto the grid, saturating at +-max_value.

    Math: `a = clip(v, -max, max)`, `e = max(floor(log2 |a|), min_exponent)`,
    `ulp = 2^(e - m)`; nearest: `q = round_half_even(a / ulp) * ulp`;
    stochastic with `u ~ U[-1/2, 1/2)`: `q = sign(a) floor(|a|/ulp + u +
    1/2) ulp`, i.e. uniform random bits added below the kept mantissa of
    `|a|`, then truncation, so `E[q] = a` (up to half the grid step of `u`,
    2^-(noise_bits+1) ulp, see `aqtr.Stochastic`) and `|q| <= max` (max is
    a grid point). NaN stays NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> FloatGrid(1, 0, 6.0).round(jnp.array([0.3, 2.6, 9.0])).tolist()
      [0.5, 3.0, 6.0]
    """
    m = self.max_value
    a = jnp.clip(v.astype(jnp.float32), -m, m)
    mag = jnp.abs(a)
    _, e = jnp.frexp(mag)  # mag = f 2^e, f in [1/2, 1)
    e = jnp.maximum(e - 1, self.min_exponent) - self.mantissa_bits
    ulp = jnp.ldexp(jnp.ones_like(mag), e)
    if noise is None:
      r = jnp.round(mag / ulp)
    else:
      r = jnp.floor(mag / ulp + (noise + 0.5))
    q = jnp.minimum(r * ulp, m)
    # The sign of `a` (zeros too) by comparisons, not jnp.copysign's bit
    # cast: XLA:CPU's constant folding got that cast's sign wrong for
    # closed-over inputs (measured on jax 0.10.2).
    return prims.where(prims.negative(a), -q, q)


@register('fp')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp(Numerics):
  """Small floats `e<E>m<M>` emulated in float32, stored exactly.

  Math (OCP 8-bit floats, Micikevicius et al. 2022, arXiv 2209.05433; OCP
  Microscaling Formats v1.0 for fp6 / fp4). E exponent bits with bias
  `2^(E-1) - 1` (one more for 'fnuz'), M mantissa bits; normal values
  `(1 + f/2^M) 2^(e - bias)`, subnormals `(f/2^M) 2^(1 - bias)`. The top
  of the range depends on `encoding`:
    'ieee'    top exponent holds inf/NaN: max `(2 - 2^-M) 2^(2^E - 2 - bias)`
    'fn'      only the all-ones code is NaN: max `(2 - 2^(1-M)) 2^(2^E-1-bias)`
    'finite'  every code is a number:         max `(2 - 2^-M) 2^(2^E-1-bias)`
    'fnuz'    bias + 1, NaN is the -0 code:   max as 'finite'
    'auto'    OCP's choice: 'ieee' for E >= 5, 'fn' for 8-bit E4M3-like
              formats (E + M = 7), 'finite' below 8 bits.
  `q = round_to_grid(clip(x/s, -max, max))` with round-to-nearest-even, or
  stochastic rounding (`FloatGrid.round`); saturates, NaN stays NaN. The
  value set equals ml_dtypes' float4_e2m1fn (E2M1), float6_e2m3fn,
  float6_e3m2fn, float8_e4m3fn, float8_e5m2 and, with 'fnuz',
  float8_e4m3fnuz / float8_e5m2fnuz.

  Storage: e4m3fn, e5m2 and the fnuz formats are stored in their own fp8
  dtype. XLA:CPU has no fp4 / fp6 dot, so the others are stored in the
  smallest of float8_e4m3fn, float8_e5m2, float16, float32 that holds each
  value exactly (E2M1, E2M3, E3M2 in float8_e4m3fn), and the dot runs in
  that dtype: the values are those of the small format, the speed is not.
  Over several tiles those formats contract as one float32 dot of the
  dequantized operands (`emulated`; train and serve alike).

  Attributes:
    exponent_bits: E, 1..5.
    mantissa_bits: M, 0..10.
    encoding: one of ENCODINGS.
    clip_gradient: zero the gradient of saturated values.

  Example:
    >>> Fp(exponent_bits=2, mantissa_bits=1).max_value
    6.0
  """

  exponent_bits: int = 4
  mantissa_bits: int = 3
  encoding: str = 'auto'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  supports_stochastic_rounding = True

  def __post_init__(self):
    for name, lo, hi in (('exponent_bits', 1, 5), ('mantissa_bits', 0, 10)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f'Fp.{name} must be an int in {lo}..{hi}, got {v!r}.')
    if self.encoding not in ENCODINGS:
      raise ValueError(
        f'Fp.encoding must be one of {ENCODINGS}, got {self.encoding!r}.'
      )
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'Fp.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )
    enc = self.resolved_encoding
    if enc == 'ieee' and self.exponent_bits < 2:
      raise ValueError(
        "Fp.encoding='ieee' needs exponent_bits >= 2 (the top exponent "
        f'is reserved), got exponent_bits={self.exponent_bits}.'
      )
    if enc == 'fn' and self.mantissa_bits < 1:
      raise ValueError(
        "Fp.encoding='fn' needs mantissa_bits >= 1 (the all-ones code is "
        f'NaN), got mantissa_bits={self.mantissa_bits}.'
      )

  @property
  def resolved_encoding(self) -> str:
    """`encoding`, with 'auto' resolved."""
    if self.encoding != 'auto':
      return self.encoding
    e, m = self.exponent_bits, self.mantissa_bits
    if e >= 5:
      return 'ieee'
    return 'fn' if e + m == 7 else 'finite'

  @property
  def bias(self) -> int:
    fnuz = self.resolved_encoding == 'fnuz'
    return 2 ** (self.exponent_bits - 1) - 1 + fnuz

  @property
  def grid(self) -> FloatGrid:
    """The format's values (see FloatGrid)."""
    e, m, enc = self.exponent_bits, self.mantissa_bits, self.resolved_encoding
    top = 2**e - 1 - self.bias - (enc == 'ieee')
    frac = 2.0 - 2.0 ** (1 - m) if enc == 'fn' else 2.0 - 2.0**-m
    return FloatGrid(m, 1 - self.bias, math.ldexp(frac, top))

  @property
  def max_value(self) -> float:
    return self.grid.max_value

  @property
  def dtype(self) -> jnp.dtype:
    key = (self.exponent_bits, self.mantissa_bits, self.resolved_encoding)
    if key in _NATIVE:
      return jnp.dtype(_NATIVE[key])
    grid = self.grid
    for name in _CONTAINERS:
      if FloatGrid.of_dtype(jnp.dtype(name)).holds(grid):
        return jnp.dtype(name)
    raise AssertionError(f'no container for {self}')  # f32 holds them all.

  @property
  def emulated(self) -> bool:
    """True unless stored in its own fp8 dtype (e4m3fn, e5m2, fnuz)."""
    key = (self.exponent_bits, self.mantissa_bits, self.resolved_encoding)
    return key not in _NATIVE

  def codec(self) -> codecs.Codec:
    """E2M1 as 4-bit codes, two per byte; other formats raw."""
    e2m1 = (self.exponent_bits, self.mantissa_bits) == (2, 1)
    if e2m1 and self.resolved_encoding == 'finite':
      return codecs.E2M1()
    return codecs.Raw()

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    return self.grid.round(v, noise).astype(self.dtype)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
