"""Ternary numerics {-1, 0, 1} (BitNet b1.58)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers
from aqtr.numerics.base import Numerics, register, within_range


@register('ternary')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Ternary(Numerics):
  """Ternary weights q in {-1, 0, 1} (BitNet b1.58: Ma et al. 2024, 2402.17764).

  Math: `q = clip(round(x / s), -1, 1)` (round half to even), stored as
  int8, `max_value = 1`, so `s = bound`. BitNet b1.58's absmean scale
  `s = gamma = mean|W|` is the `rms` calibration with p=1, c=1:

    TensorConfig(numerics=Ternary(), calibration=Rms(p=1.0, c=1.0))

  (with the default absmax calibration most weights round to 0). The grid
  is that of `IntSymmetric(bits=2)`; `IntSymmetric(bits=1,
  preserve_zero=False)` is the binary {-1/2, 1/2} form. The dot is a real
  int8 x int8 -> int32 dot. Stochastic rounding adds the noise after the
  clip, like IntSymmetric, so it is unbiased inside [-1, 1].

  Attributes:
    clip_gradient: zero the straight-through gradient where |x/s| > 1.

  Example:
    >>> import jax.numpy as jnp
    >>> Ternary().quantize(jnp.array([-2.0, -0.4, 0.5, 0.7])).tolist()
    [-1, 0, 0, 1]
  """

  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  supports_stochastic_rounding = True
  kind = 'int'

  def __post_init__(self):
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'Ternary.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )

  @property
  def max_value(self) -> float:
    return 1.0

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.int8)

  def codec(self) -> codecs.Codec:
    """{-1, 0, 1} as 4-bit codes, two per byte."""
    return codecs.Int4()

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    v = jnp.clip(v, -1.0, 1.0)
    if noise is not None:
      v = v + noise
    return jnp.clip(jnp.round(v), -1.0, 1.0).astype(jnp.int8)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, 1.0)
