"""Frozen weights: store the integer values and scales of an operand."""

from __future__ import annotations

import dataclasses

from aqtr.freezers.base import Freezer, Mode, Served, register


@register('weights')
@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightsFreezer(Freezer):
  """Stores the quantized operand (qvalue + scale); serving needs no float.

  Math. CONVERT runs the forward quantization of the operand once,
  `q = Q(x / s)`, `s = bound(x) / qmax` (exactly what TRAIN computes on the
  fly, `aqtr.quantize_operand`), and stores `q` (int8 / int4 / fp8) and `s`
  in the tiled view of the dot. SERVE passes them as a QTensor to
  `aqtr.dot_general`, whose output is bit-identical to TRAIN's: what you
  train is what you serve. The float operand is not read in SERVE, so the
  float kernel need not be loaded (see `aqtr.flax` conversion).

  Example:
    >>> WeightsFreezer().stores(Mode.CONVERT)
    ('qvalue', 'scale')
  """

  frozen_parts = ('qvalue', 'scale')
  reads_float = False

  def stores(self, mode: Mode) -> tuple[str, ...]:
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def freeze(self, call, stats) -> dict:
    del stats
    q = call.quantize()
    return {'qvalue': q.qvalue, 'scale': q.scale}

  def serve(self, call, frozen: dict) -> Served:
    return Served(call.qtensor(frozen['qvalue'], frozen['scale']))
