"""Weight formats of quantized training: int8, int4 group-wise, fp8 e4m3.

A format quantizes a float weight `w` into a `QTParam` (stored values and a
scale) with round-to-nearest or stochastic rounding, through the engine's
own pieces: the format's calibration (absmax), `aqtr.core.scale` and the
format's numerics (`IntSymmetric` / `Fp8`):

  s_G = max_{i in G} |w_i| / qmax        (one scale per group G)
  q_i = Q(w_i / s_G + u_i),  u ~ U[-1/2, 1/2)  (int, stochastic rounding)

so `E[q_i s_G] = w_i` (Gupta et al. 2015, arXiv 1502.02551). Groups: int8
and fp8 have one scale per output channel (every index of the free axes,
the recipe of torchao's int8 quantized training); int4 has one per block of
`group_size` elements of the contraction axes. fp8 e4m3 stochastic rounding
adds the noise below the 3 kept mantissa bits of the float32 value and
truncates (`aqtr.numerics.fp.FloatGrid.round`), which is unbiased for
every float in range.

The scale is rounded up (`aqtr.core.scale.requantizable`) so that it is a
fixed point of `s -> (qmax * s) / qmax` in float32: quantizing the
dequantized weight again (what `aqtr.dot_general` does to a float weight
operand) gives back the same values and scale bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from aqtr import presets
from aqtr.calibrations.absmax import AbsMax
from aqtr.core.config import TensorConfig
from aqtr.core.dimension_numbers import OperandLayout, normalize_axes
from aqtr.core.rounding import uniform_grid
from aqtr.core.scale import requantizable, scale_from_bound
from aqtr.freezers.base import NoFreezer
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel

__all__ = ['WeightFormat', 'fp8', 'int4', 'int8']

_KINDS = ('int8', 'int4', 'fp8')
_GROUPS = (32, 64, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightFormat:
  """How a quantized-training weight is stored.

  Attributes:
    kind: 'int8' (per-channel), 'int4' (group-wise, packed two per byte) or
      'fp8' (float8_e4m3fn, per-channel).
    group_size: int4 only: elements of the contraction axes per scale, one
      of 32, 64, 128 (0 for int8 / fp8).
    contracting_axes: the axes the weight's dot contracts; None: every axis
      but the last (Flax Dense / Conv kernels).

  Example:
    >>> WeightFormat(kind='int4', group_size=64).qmax
    7.0
  """

  kind: str = 'int8'
  group_size: int = 0
  contracting_axes: tuple[int, ...] | None = None

  GROUPS: ClassVar[tuple[int, ...]] = _GROUPS

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(
        f'WeightFormat.kind must be one of {_KINDS}, got {self.kind!r}.'
      )
    g = self.group_size
    if self.kind == 'int4' and g not in _GROUPS:
      raise ValueError(
        f'WeightFormat.group_size must be one of {_GROUPS} for int4, got {g!r}.'
      )
    if self.kind != 'int4' and g != 0:
      raise ValueError(
        f'WeightFormat.group_size must be 0 for {self.kind}, got {g!r}.'
      )
    axes = self.contracting_axes
    if axes is not None and not (
      isinstance(axes, tuple) and all(isinstance(a, int) for a in axes)
    ):
      raise TypeError(
        'WeightFormat.contracting_axes must be a tuple of ints or None, got '
        f'{axes!r}.'
      )
    if axes is not None and len(set(axes)) != len(axes):
      raise ValueError(
        f'WeightFormat.contracting_axes repeats an axis: {axes}.'
      )

  @property
  def numerics(self):
    """The engine numerics of the stored values."""
    if self.kind == 'fp8':
      return Fp8(dtype_name='float8_e4m3fn', clip_gradient=False)
    bits = 8 if self.kind == 'int8' else 4
    storage = 'int4' if bits == 4 else 'int8'
    return IntSymmetric(
      bits=bits,
      preserve_zero=True,
      preserve_max_val=True,
      clip_gradient=False,
      storage=storage,
    )

  @property
  def qmax(self) -> float:
    return float(self.numerics.max_value)

  def tensor_config(self) -> TensorConfig:
    """The engine's TensorConfig for a weight operand stored in this format.

    A dot whose `fwd.rhs` is this config and whose rhs is the dequantized
    weight re-quantizes it to the stored values exactly.
    """
    tiling = (
      SubChannel(tile_size=self.group_size)
      if self.kind == 'int4'
      else PerChannel()
    )
    return TensorConfig(
      numerics=self.numerics,
      calibration=AbsMax(clip_scale=1.0, po2_scale=False),
      tiling=tiling,
      freezer=NoFreezer(),
    )

  def layout(self, shape: tuple[int, ...], name: str) -> OperandLayout:
    """The weight's operand layout; checks it can be grouped."""
    rank = len(shape)
    axes = self.contracting_axes
    if axes is None:
      axes = tuple(range(rank - 1))
    if rank < 2 or not axes or len(axes) >= rank:
      raise ValueError(
        f'parameter {name!r} of shape {shape} cannot be quantized as a '
        f'weight: it needs at least one contraction axis and one free axis '
        f'(contracting_axes={self.contracting_axes}).'
      )
    axes = normalize_axes(
      axes, rank, f'WeightFormat.contracting_axes for parameter {name!r}'
    )
    lay = OperandLayout(tuple(shape), (), axes)
    if self.kind == 'int4' and lay.k % self.group_size:
      raise ValueError(
        f'parameter {name!r} of shape {shape} is too small to group: its '
        f'contraction size {lay.k} is not a multiple of group_size='
        f'{self.group_size}; exclude it from the rules or use int8.'
      )
    return lay


def int8(contracting_axes: tuple[int, ...] | None = None) -> WeightFormat:
  """int8 per output channel (torchao's int8 quantized-training recipe)."""
  return WeightFormat(kind='int8', contracting_axes=contracting_axes)


def int4(
  group_size: int = 64, contracting_axes: tuple[int, ...] | None = None
) -> WeightFormat:
  """int4, one scale per `group_size` elements of the contraction."""
  return WeightFormat(
    kind='int4', group_size=group_size, contracting_axes=contracting_axes
  )


def fp8(contracting_axes: tuple[int, ...] | None = None) -> WeightFormat:
  """float8_e4m3fn per output channel."""
  return WeightFormat(kind='fp8', contracting_axes=contracting_axes)


def weight_scale(bound: jax.Array, fmt: WeightFormat) -> jax.Array:
  """The stored scale of weight groups with calibrated `bound`.

  The engine's scale (`aqtr.core.scale.scale_from_bound`: `bound / qmax`,
  kept normal, 1 for an all-zero group, NaN for a non-finite bound) made
  `requantizable`: every `qmax * s` is exact, so re-calibrating the
  dequantized weight gives back s bit for bit (see the module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> import jax.numpy as jnp
    >>> float(weight_scale(jnp.float32(127.0), int8()))
    1.0
  """
  n = fmt.numerics
  return requantizable(scale_from_bound(bound, n), n.max_value)


def quantize_values(
  v: jax.Array, fmt: WeightFormat, key: jax.Array | None
) -> jax.Array:
  """Rounds scaled values `v` to the stored dtype with the engine numerics.

  Round to nearest without a key; with one, stochastic rounding with
  noise on the 2^16-point grid of `aqtr.core.rounding.uniform_grid` (so
  updates down to 2^-17 of a step survive in expectation), which the
  numerics add before rounding (int) or below the kept mantissa (fp8).
  """
  noise = None if key is None else uniform_grid(key, v.shape, bits=16)
  return fmt.numerics.quantize(v, noise)


def dot_config(fmt: WeightFormat, activation_bits: int | None = 8):
  """The DotGeneralConfig of a QT weight's forward: weights in `fmt`.

  The weight operand (rhs) is quantized as `fmt` stores it, so passing the
  dequantized QT weight re-quantizes it to the stored values exactly and
  passing `QTParam.qtensor()` gives the same output bit for bit (serving).
  With `activation_bits=8` the activations are int8 per row and the
  forward is a real int8 x int8 dot (int8 weights); None keeps them float.
  Gradients are float (straight through the forward's quantization).

  Example:
    >>> dot_config(int8()).fwd.lhs.numerics.bits
    8
  """
  if activation_bits not in (None, 8):
    raise ValueError(
      f'dot_config: activation_bits must be 8 or None, got {activation_bits!r}.'
    )
  base = presets.int8_fwd() if activation_bits else presets.int8_weight_only()
  w = fmt.tensor_config()
  return dataclasses.replace(
    base,
    fwd=dataclasses.replace(base.fwd, rhs=w),
    dlhs=dataclasses.replace(base.dlhs, rhs=w),
  )
