"""NVFP4: fp4 (E2M1) elements, 16-element blocks, e4m3 x f32 scales."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers
from aqtr.numerics.base import Numerics, register, within_range
from aqtr.numerics.fp import FloatGrid, Fp

_E2M1 = Fp(exponent_bits=2, mantissa_bits=1)
_E4M3 = FloatGrid.of_dtype(jnp.float8_e4m3fn)
_E4M3_MAX = 448.0
_E4M3_MIN = 2.0**-9  # the smallest positive (subnormal) e4m3 value
# Significant bits kept in the tensor scale: e4m3 (4) + e2m1 (2) + 18 = 24,
# float32's precision, so q * d * s_t is exact in float32.
TENSOR_SCALE_BITS = 18
# How the e4m3 block scale is rounded (see `NvFp4`).
SCALE_MODES = ('nearest', 'ceil')


def tensor_scale(amax: jax.Array, top: float) -> jax.Array:
  """`amax / top` rounded up to TENSOR_SCALE_BITS significant bits (0 -> 1).

  Example:
    >>> import jax.numpy as jnp
    >>> float(tensor_scale(jnp.float32(2688.0), 2688.0))
    1.0
  """
  s = amax.astype(jnp.float32) / jnp.float32(top)
  m, e = jnp.frexp(s)  # s = m 2^e, m in [1/2, 1); m 2^bits is exact.
  m = jnp.ceil(m * 2.0**TENSOR_SCALE_BITS) * 2.0**-TENSOR_SCALE_BITS
  return jnp.where(amax > 0, jnp.ldexp(m, e), jnp.float32(1))


@register('nvfp4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NvFp4(Numerics):
  """NVIDIA's NVFP4: E2M1 elements with a two-level block scale.

  Math (NVIDIA Blackwell NVFP4; "Pretraining LLMs with NVFP4", NVIDIA 2025,
  arXiv 2509.25149). Per tensor `s_t = amax_tensor / (448 * 6)` (float32,
  rounded up to 18 significant bits); per block of 16 consecutive elements
  along the contraction axis `d = e4m3(amax_block / (6 s_t))` (at least
  e4m3's smallest value 2^-9), `s = d * s_t`; elements `q = e2m1(x / s)`
  (nearest even, saturating at 6, or stochastic). amax_block is the
  calibration's bound per block and amax_tensor its maximum over the whole
  operand. The QTensor keeps `s` (the product) as float32.

  The two-level scale is exact: d has 4 significant bits, s_t 18, so
  `s = d * s_t` is an exact float32 product (`s / s_t` is the e4m3 block
  scale d, bit for bit) and the dequantized `q * s` (q has 2 significant
  bits) equals `q * d * s_t` exactly: a kernel given (q, d, s_t) computes
  the same values (tensors with amax below ~1e-34 aside, whose scales
  would be subnormal).

  `scale_mode` rounds the block scale: 'nearest' (NVIDIA's recipe) may
  round d down (by up to 1/16 for normal e4m3 values, d >= 2^-6; more for
  subnormal ones, blocks ~2^15 below the tensor's amax), so a block's
  largest values (up to 6.375 s for a normal d) saturate at 6 s; 'ceil'
  rounds d up to the next e4m3 value, so no value saturates.

  Stochastic rounding (`aqtr.Stochastic()`, the recipe's rounding of
  gradients): uniform noise below E2M1's last mantissa bit
  (`FloatGrid.round`), `E[q] = x / s` for every unsaturated value (every
  value with 'ceil').

  The blocks are the engine's sub-channel tiles: a TensorConfig with NvFp4
  must use `SubChannel(tile_size=16)` or the 16x16 2-D weight blocks
  `Block2d(tile_size=16, free_size=16)` (validated); the contraction must
  be a multiple of 16. XLA:CPU has no fp4 dot: the E2M1 values are stored
  in float8_e4m3fn (exactly) and the dot runs in fp8.

  Attributes:
    scale_mode: one of SCALE_MODES.
    clip_gradient: zero the gradient of saturated values.

  Example:
    >>> NvFp4().max_value, NvFp4().block_size
    (6.0, 16)
  """

  scale_mode: str = 'nearest'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  BLOCK_SIZE: ClassVar[int] = 16
  supports_stochastic_rounding = True

  def __post_init__(self):
    if self.scale_mode not in SCALE_MODES:
      hint = (
        " ('rceil' is MX's E8M0 scale selection: numerics Mx)"
        if self.scale_mode == 'rceil'
        else ''
      )
      raise ValueError(
        f'NvFp4.scale_mode must be one of {SCALE_MODES}, got '
        f'{self.scale_mode!r}{hint}.'
      )
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

  def codec(self) -> codecs.Codec:
    """The E2M1 elements as 4-bit codes, two per byte."""
    return _E2M1.codec()

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    finite = jnp.isfinite(bound)
    amax = jnp.max(jnp.where(finite, bound, 0))
    s_t = tensor_scale(amax, _E4M3_MAX * self.max_value)
    y = bound / (self.max_value * s_t)
    d = y.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    if self.scale_mode == 'ceil':
      d = _up(d, y)
      # y is rounded: one more step if a value still saturates (the
      # products 6 d s_t are exact, so the test is exact).
      d = _up(d, jnp.where(bound > 6.0 * (d * s_t), jnp.inf, d))
    d = jnp.maximum(d, _E4M3_MIN)
    return jnp.where(finite, d * s_t, jnp.float32(jnp.nan))

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    return _E2M1.quantize(v, noise)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)


def _up(d: jax.Array, y: jax.Array) -> jax.Array:
  """d (an e4m3 value), moved one e4m3 step up where `d < y` (<= 448)."""
  _, e = jnp.frexp(jnp.maximum(d, _E4M3_MIN))
  e = jnp.maximum(e - 1, _E4M3.min_exponent) - _E4M3.mantissa_bits
  step = jnp.ldexp(jnp.ones_like(d), e)
  return jnp.where(d < y, jnp.minimum(d + step, _E4M3_MAX), d)
