"""Frozen weights: store the integer values and scales of an operand."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from aqtr.core.lowering import dot_kind
from aqtr.core.qtensor import swapped_view
from aqtr.freezers.base import Freezer, Mode, Served, register


def minor_k(call, parts: dict) -> bool:
  """Whether the frozen `parts` ({qvalue, scale[, zero_point]} in the view
  `call.quantize()` gives) of operand `call` are stored with their
  contraction minor ('fk', [.., N, K]) instead of the 'kf' view they were
  quantized in ([.., K, N], e.g. a Dense kernel).

  An int8 x int8 dot of a few activation rows runs 2-3x faster on
  XLA:CPU at 4096-wide layers with the weight stored [N, K] (both operands
  contracting their minor axis; a transposed copy inside a serving
  program is not hoisted out of a decode loop, so the codes are stored
  that way). Integer sums are exact, so the served output is the same
  bits. Only where that holds: the rhs of a plain dot whose forward is
  integer x integer, symmetric, unrotated, with one scale per output
  column or more (`stored_form` reads the view back from the scale).

  Args:
    call: the operand's `OperandCall`.
    parts: its frozen parts in the quantized view.

  Returns:
    True to store them swapped (`aqtr.core.qtensor.swapped_view`).
  """
  fwd = call.call.config.fwd
  scale = parts.get('scale')
  return (
    call.side == 'rhs'
    and call.call.group_sizes is None
    and call.form == 'kf'
    and parts.get('zero_point') is None
    and not call.tensor.rotated
    and scale is not None
    and jnp.ndim(scale) == 4
    and jnp.shape(scale)[-1] > 1
    and jnp.shape(scale)[-2] == 1
    and fwd.lhs.quantized
    and dot_kind(fwd.lhs.numerics.dot_dtype, fwd.rhs.numerics.dot_dtype, fwd)
    == 'int'
  )


def frozen_view(call, parts: dict) -> dict:
  """`parts` (in the view `call.quantize()` gives) as CONVERT stores them:
  swapped to the contraction minor where `minor_k`, else as they are."""
  return swapped_view(parts) if minor_k(call, parts) else parts


@register('weights')
@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightsFreezer(Freezer):
  """Stores the quantized operand (qvalue + scale); serving needs no float.

  Math. CONVERT runs the forward quantization of the operand once,
  `q = Q(x / s)`, `s = bound(x) / qmax` (exactly what TRAIN computes on the
  fly, `aqtr.quantize_operand`), and stores `q` (int8 / int4 / fp8) and `s`
  in the tiled view of the dot (and the zero point `z` of affine numerics,
  `x ~ s (q - z)`). SERVE passes them as a QTensor to
  `aqtr.dot_general`, whose output is bit-identical to TRAIN's: what you
  train is what you serve. The float operand is not read in SERVE, so the
  float kernel need not be loaded (see `aqtr.flax` conversion).

  Example:
    >>> WeightsFreezer().stores(Mode.CONVERT)
    ('qvalue', 'scale')
  """

  frozen_parts = ('qvalue', 'scale')
  optional_parts = ('zero_point',)
  reads_float = False

  def stores(self, mode: Mode) -> tuple[str, ...]:
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def freeze(self, call, stats) -> dict:
    del stats
    q = call.quantize()
    parts = {'qvalue': q.qvalue, 'scale': q.scale}
    if q.zero_point is not None:  # Affine numerics (int_asymmetric).
      parts['zero_point'] = q.zero_point
    return frozen_view(call, parts)

  def serve(self, call, frozen: dict) -> Served:
    return Served(  # The view (as quantized, or 'fk') read from the scale.
      call.qtensor(frozen['qvalue'], frozen['scale'], frozen.get('zero_point'))
    )
