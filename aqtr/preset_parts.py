"""The parts named configs are built from: one operand, one pass.

`aqtr.presets`, `aqtr.fp4_recipes` and `aqtr.fp8_recipes` spell out every
field of the trees they return (no field left to a dataclass default), so
Fiddle selectors and tree walkers see every leaf; these two builders are
where that is done once.

Example:
  >>> from aqtr.numerics.int_symmetric import IntSymmetric
  >>> w = operand(IntSymmetric(bits=8))
  >>> type(w.tiling).__name__, type(w.calibration).__name__
  ('PerChannel', 'AbsMax')
  >>> raw(w, w, fwd_quant=False).accumulator
  'auto'
"""

from __future__ import annotations

from aqtr.calibrations.absmax import AbsMax
from aqtr.calibrations.base import Calibration
from aqtr.core.config import DotGeneralRaw, TensorConfig
from aqtr.core.rounding import NearestEven, Rounding
from aqtr.freezers.base import NoFreezer
from aqtr.numerics.base import Numerics
from aqtr.sparsity.base import Sparsity
from aqtr.sparsity.none import NoSparsity
from aqtr.tilings.base import Tiling
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel
from aqtr.transforms.base import Transform
from aqtr.transforms.none import NoTransform

__all__ = ['operand', 'raw']


def operand(
  numerics: Numerics,
  rounding: Rounding | None = None,
  *,
  tiling: Tiling | None = None,
  calibration: Calibration | None = None,
  sparsity: Sparsity | None = None,
  transform: Transform | None = None,
  quantized_gather: bool = False,
) -> TensorConfig:
  """One operand's config with every field set.

  Defaults: absmax scales (no clipping, no power-of-two rounding), round
  to nearest even, no sparsity, no transform, no freezer, and a tiling of
  one scale per channel, or per block of the numerics' `block_size` for
  block formats (MX, NVFP4).

  Args:
    numerics: the operand's number format.
    rounding: None for round to nearest even.
    tiling: None for per channel, or the numerics' blocks.
    calibration: None for absmax.
    sparsity: None for dense.
    transform: None for no transform.
    quantized_gather: gather FSDP shards quantized
      (`TensorConfig.quantized_gather`).

  Returns:
    The TensorConfig.

  Example:
    >>> from aqtr.numerics.mx import Mx
    >>> operand(Mx(element='fp8_e4m3')).tiling
    SubChannel(tile_size=32, tile_count=0)
  """
  if tiling is None:
    block = numerics.block_size
    tiling = (
      PerChannel()
      if block is None
      else SubChannel(tile_size=block, tile_count=0)
    )
  return TensorConfig(
    numerics=numerics,
    calibration=calibration or AbsMax(clip_scale=1.0, po2_scale=False),
    tiling=tiling,
    sparsity=sparsity or NoSparsity(),
    rounding=rounding or NearestEven(),
    transform=transform or NoTransform(),
    freezer=NoFreezer(),
    quantized_gather=quantized_gather,
  )


def raw(lhs: TensorConfig, rhs: TensorConfig, fwd_quant: bool) -> DotGeneralRaw:
  """One pass: its two operands, whether a backward pass reuses the
  forward's codes (`use_fwd_quant`), and the automatic accumulator.

  Example:
    >>> from aqtr.numerics.none import NoNumerics
    >>> f = operand(NoNumerics())
    >>> raw(f, f, fwd_quant=True).use_fwd_quant
    True
  """
  return DotGeneralRaw(
    lhs=lhs, rhs=rhs, use_fwd_quant=fwd_quant, accumulator='auto'
  )
