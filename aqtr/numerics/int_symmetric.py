"""Symmetric integer numerics (AQT's IntSymmetric)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers, prims
from aqtr.core.rounding import Rounding
from aqtr.numerics.base import Numerics, register, within_range

_STORAGE = ('int8', 'int4')


@register('int_symmetric')
@dataclasses.dataclass(frozen=True, kw_only=True)
class IntSymmetric(Numerics):
  """Signed integers of `bits` bits on a grid symmetric around zero.

  Math (after AQT, Lew et al. 2022, github.com/google/aqt):
    edge = 2^(b-1) - 0.5 [preserve_zero],  max_value = edge - 0.5 [pmv]
    v = clip(x/s, -max_value, max_value) (+ noise u ~ U[-1/2, 1/2))
    preserve_zero:  q = round_half_even(v), clipped to +-(edge - 0.5)
    otherwise:      q = floor(v) + 1/2   (the "half" grid; bits=1 gives
                    +-1/2, i.e. values +-s/2), stored doubled as odd ints.
  8 bits with preserve_zero and preserve_max_val gives [-127, 127] with the
  calibrated bound mapped exactly to 127. Stochastic rounding is unbiased
  when the bound maps inside the clip range, i.e. preserve_max_val=True.
  `clip_gradient` masks the straight-through gradient to |x/s| <= max_value.

  Attributes:
    bits: 1..8.
    preserve_zero: keep 0 on the grid (else the half grid, no zero).
    preserve_max_val: map the bound onto the top grid point.
    clip_gradient: zero the gradient of clipped values.
    storage: 'int8' or 'int4' (int4 needs a grid within [-8, 7]; it is
      widened to int8 for the dot on backends without int4 dots).

  Example:
    >>> IntSymmetric(bits=8, preserve_max_val=True).max_value
    127.0
  """

  bits: Annotated[int, markers.Bits] = 8
  preserve_zero: bool = True
  preserve_max_val: bool = True
  clip_gradient: Annotated[bool, markers.ClipGradient] = False
  storage: str = 'int8'

  supports_stochastic_rounding = True
  kind = 'int'

  def __post_init__(self):
    if isinstance(self.bits, bool) or not isinstance(self.bits, int):
      raise TypeError(
        f'IntSymmetric.bits must be an int in 1..8, got {self.bits!r}.'
      )
    if not 1 <= self.bits <= 8:
      raise ValueError(f'IntSymmetric.bits must be in 1..8, got {self.bits}.')
    if self.bits == 1 and self.preserve_zero:
      raise ValueError(
        'IntSymmetric.bits=1 needs preserve_zero=False (the binary grid '
        '+-s/2); with preserve_zero=True the 1-bit grid is {0}.'
      )
    for name in ('preserve_zero', 'preserve_max_val', 'clip_gradient'):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(
          f'IntSymmetric.{name} must be a bool, got {getattr(self, name)!r}.'
        )
    if self.storage not in _STORAGE:
      raise ValueError(
        f'IntSymmetric.storage must be one of {_STORAGE}, got {self.storage!r}.'
      )
    if self.storage == 'int4' and self.max_stored > 7:
      raise ValueError(
        f'IntSymmetric.storage=int4 holds [-8, 7] but bits={self.bits}, '
        f'preserve_zero={self.preserve_zero} stores up to '
        f'{self.max_stored}; use storage="int8" or fewer bits.'
      )

  @property
  def edge(self) -> float:
    return 2.0 ** (self.bits - 1) - 0.5 * self.preserve_zero

  @property
  def max_value(self) -> float:
    return self.edge - 0.5 * self.preserve_max_val

  @property
  def unit(self) -> float:
    return 1.0 if self.preserve_zero else 0.5

  @property
  def max_stored(self) -> int:
    """Largest stored magnitude (half-grid values are stored doubled)."""
    return int((self.edge - 0.5) / self.unit)

  @property
  def dtype(self) -> jnp.dtype:
    if self.storage == 'int4':
      return jnp.dtype(jnp.int4)
    return jnp.dtype(jnp.int8 if self.max_stored <= 127 else jnp.int16)

  @property
  def dot_dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.int8) if self.storage == 'int4' else self.dtype

  def codec(self) -> codecs.Codec:
    """4-bit codes two per byte when the grid fits [-8, 7]."""
    return codecs.Int4() if self.max_stored <= 7 else codecs.Raw()

  def check_rounding(self, rounding: Rounding) -> None:
    """Stochastic rounding needs preserve_max_val=True to be unbiased."""
    super().check_rounding(rounding)
    if rounding.stochastic and not self.preserve_max_val:
      raise ValueError(
        'TensorConfig.rounding: stochastic rounding with '
        'IntSymmetric(preserve_max_val=False) maps the bound outside the '
        'clip range and biases the top bucket; set preserve_max_val=True.'
      )

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    top = self.edge - 0.5
    v = prims.clip(v, -self.max_value, self.max_value)
    if noise is not None:
      v = v + noise
    if self.preserve_zero:
      q = prims.round_even(v)
      if noise is not None or self.max_value > top:  # Else already within.
        q = prims.clip(q, -top, top)
    else:  # Half grid, stored doubled: 2 * (floor(v) + 1/2).
      q = prims.clip(2.0 * jnp.floor(v) + 1.0, -2 * top, 2 * top)
    return q.astype(self.dtype)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
