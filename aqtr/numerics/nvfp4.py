"""NVFP4: fp4 (E2M1) elements, 16-element blocks, e4m3 x f32 scales."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp

from aqtr.core import markers
from aqtr.numerics.base import Numerics, register, within_range
from aqtr.numerics.fp import Fp

_E2M1 = Fp(exponent_bits=2, mantissa_bits=1)
_E4M3_MAX = 448.0
_E4M3_MIN = 2.0**-9  # the smallest positive (subnormal) e4m3 value


@register('nvfp4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NvFp4(Numerics):
  """NVIDIA's NVFP4: E2M1 elements with a two-level block scale.

  Math (NVIDIA Blackwell NVFP4; "Pretraining LLMs with NVFP4", NVIDIA 2025,
  arXiv 2509.25149). Per tensor `s_t = amax_tensor / (448 * 6)` (float32);
  per block of 16 consecutive elements along the contraction axis
  `d = e4m3(amax_block / (6 s_t))` (round to nearest, at least e4m3's
  smallest value 2^-9), `s = d * s_t`; elements `q = e2m1(x / s)`
  (nearest even, saturating at 6). amax_block is the calibration's bound
  per block and amax_tensor its maximum over the whole operand. The
  QTensor keeps `s` (the product) as float32.

  The blocks are the engine's sub-channel tiles: a TensorConfig with NvFp4
  must use `SubChannel(tile_size=16)` (validated); the contraction must be
  a multiple of 16. XLA:CPU has no fp4 dot: the E2M1 values are stored in
  float8_e4m3fn (exactly) and the dot runs in fp8.

  Attributes:
    clip_gradient: zero the gradient of saturated values.

  Example:
    >>> NvFp4().max_value, NvFp4().block_size
    (6.0, 16)
  """

  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  BLOCK_SIZE: ClassVar[int] = 16

  def __post_init__(self):
    if not isinstance(self.clip_gradient, bool):
      raise TypeError(
        f'NvFp4.clip_gradient must be a bool, got {self.clip_gradient!r}.'
      )

  @property
  def block_size(self) -> int:
    """Elements per block along the contraction axis (the tile size)."""
    return self.BLOCK_SIZE

  @property
  def max_value(self) -> float:
    return _E2M1.max_value

  @property
  def dtype(self) -> jnp.dtype:
    return _E2M1.dtype

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    amax = jnp.max(jnp.where(jnp.isfinite(bound), bound, 0))
    top = _E4M3_MAX * self.max_value
    s_t = jnp.where(amax > 0, amax / top, jnp.float32(1))
    d = (bound / (self.max_value * s_t)).astype(jnp.float8_e4m3fn)
    d = jnp.maximum(d.astype(jnp.float32), _E4M3_MIN)
    return jnp.where(jnp.isfinite(bound), d * s_t, jnp.float32(jnp.nan))

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if noise is not None:
      raise ValueError('NvFp4 does not support stochastic rounding.')
    return _E2M1.quantize(v)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
