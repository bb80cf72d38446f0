"""OCP Microscaling (MX) block formats: MXFP8, MXFP6, MXFP4, MXINT8."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers
from aqtr.core.rounding import Rounding
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
# How the shared E8M0 scale is chosen from the block's amax (see `Mx`).
SCALE_MODES = ('floor', 'ceil', 'rceil')
_INT8_UNIT = 2.0**-6


def po2_scale(
  bound: jax.Array, emax: int, mode: str = 'floor', max_value: float = 0.0
) -> jax.Array:
  """The E8M0 shared scale X of a block from its amax `bound` (0 -> 1).

  `floor`: `2^(floor(log2 bound) - emax)`; `ceil`: `2^(ceil(log2 bound) -
  emax)`; `rceil`: `2^ceil(log2(bound / max_value))` (see `Mx`), computed
  exactly from the exponent of `bound`: with `max_value` in
  [2^emax, 2^(emax+1)), rceil is the floor scale, doubled when
  `bound > max_value * X_floor`. The exponent is clamped to E8M0's range
  [-127, 127]; a NaN / inf bound gives a NaN scale (so the group's output
  is NaN, not clipped).

  Example:
    >>> import jax.numpy as jnp
    >>> po2_scale(jnp.array([1000.0, 0.0]), emax=8).tolist()
    [2.0, 1.0]
    >>> po2_scale(jnp.array([7.0]), 2, 'rceil', max_value=6.0).tolist()
    [2.0]
  """
  bound = bound.astype(jnp.float32)
  m, e = jnp.frexp(bound)  # bound = m 2^e, m in [1/2, 1): floor(log2) = e-1
  e = e - 1 - emax
  if mode == 'ceil':
    e = jnp.where(m == 0.5, e, e + 1)
  elif mode == 'rceil':  # max_value 2^e is exact: the test is exact.
    e = jnp.where(bound > jnp.ldexp(jnp.float32(max_value), e), e + 1, e)
  e = jnp.clip(e, -127, 127)
  s = jnp.ldexp(jnp.ones_like(bound), e)
  s = jnp.where(bound > 0, s, jnp.float32(1))
  return jnp.where(jnp.isfinite(bound), s, jnp.float32(jnp.nan))


@register('mx')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mx(Numerics):
  """OCP Microscaling: 32-element blocks sharing one power-of-two scale.

  Math (OCP Microscaling Formats (MX) v1.0, 2023; Rouhani et al. 2023,
  arXiv 2310.10537). Per block of 32 consecutive elements along the
  contraction axis, with amax the block's absolute maximum (the
  calibration's bound), emax_elem the exponent of the element format's
  largest normal (e4m3 8, e5m2 15, e2m3 2, e3m2 4, e2m1 2, int8 0) and
  max_elem that value (448, 57344, 7.5, 28, 6, 127/64), the shared scale X
  is chosen by `scale_mode`:

    'floor'  X = 2^(floor(log2 amax) - emax_elem)   (OCP MX v1.0, 6.3).
             amax / X lies in [2^emax, 2^(emax+1)), so values above
             max_elem X are clamped (fp4: 6 < |x| / X < 8 become 6).
    'ceil'   X = 2^(ceil(log2 amax) - emax_elem)    (torchao CEIL).
             amax / X <= 2^emax_elem: never clamps, and the top binade's
             values above 2^emax_elem (e2m1 6, e4m3 288..448) go unused.
    'rceil'  X = 2^ceil(log2(amax / max_elem))      (torchao RCEIL, cuBLAS
             MX block scaling): the smallest power of two with
             amax / X <= max_elem: never clamps, uses the whole range.

  The elements `x / X` are rounded to the element format, nearest even or
  stochastically (`aqtr.Stochastic()` as the operand's rounding: uniform
  noise below the element's last mantissa bit, see `FloatGrid.round`;
  MXINT8 `q = round(v + u)`), so `E[q] = x / X` for every element that is
  not clamped. Stochastic rounding therefore needs a scale mode that never
  clamps ('rceil' or 'ceil'; 'floor' is refused). X is an E8M0 value (a
  power of two in [2^-127, 2^127], exact in float8_e8m0fnu); the QTensor
  keeps it as float32. MXINT8 elements are int8 times 2^-6 (|q| <= 127,
  the symmetric range).

  The blocks are the engine's sub-channel tiles: a TensorConfig with Mx
  must use `SubChannel(tile_size=32)` (validated), so the scale factors
  out of each tile's dot, and the contraction must be a multiple of 32.
  MXFP8 and MXINT8 run fp8 / int8 dots; XLA:CPU has no fp6 / fp4 dot, so
  those elements are stored in float8_e4m3fn (exactly) and the dot runs in
  fp8.

  Attributes:
    element: one of ELEMENTS.
    scale_mode: one of SCALE_MODES.
    clip_gradient: zero the gradient of clamped values.

  Example:
    >>> Mx(element='fp4_e2m1').max_value, Mx(element='fp4_e2m1').emax
    (6.0, 2)
  """

  element: str = 'fp8_e4m3'
  scale_mode: str = 'floor'
  clip_gradient: Annotated[bool, markers.ClipGradient] = False

  BLOCK_SIZE: ClassVar[int] = 32
  supports_stochastic_rounding = True

  def __post_init__(self):
    if self.element not in ELEMENTS:
      raise ValueError(
        f'Mx.element must be one of {tuple(ELEMENTS)}, got {self.element!r}.'
      )
    if self.scale_mode not in SCALE_MODES:
      raise ValueError(
        f'Mx.scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}.'
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

  def codec(self) -> codecs.Codec:
    """The element format's codec (MXFP4: E2M1 codes); MXINT8 raw."""
    return codecs.Raw() if self.fp is None else self.fp.codec()

  def check_rounding(self, rounding: Rounding) -> None:
    """Stochastic rounding needs a scale mode that never clamps."""
    super().check_rounding(rounding)
    if rounding.stochastic and self.scale_mode == 'floor':
      raise ValueError(
        'TensorConfig.rounding: stochastic rounding with Mx(scale_mode='
        "'floor') is biased (values above max_elem * X are clamped); set "
        "scale_mode='rceil' (or 'ceil'), or use NearestEven()."
      )

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    return po2_scale(bound, self.emax, self.scale_mode, self.max_value)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if self.fp is None:
      u = v / _INT8_UNIT
      if noise is not None:
        u = jnp.clip(u, -127, 127) + noise
      q = jnp.clip(jnp.round(u), -127, 127)
      return q.astype(jnp.int8)
    return self.fp.quantize(v, noise)

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    if not self.clip_gradient:
      return None
    return within_range(v, self.max_value)
