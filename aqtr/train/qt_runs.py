"""Runs of the main job that train with `aqtr.qt`.

  qt_int8         int8 per-channel weights with no float copy (quantized
                  training, stochastic rounding); float activations.
  qt_int8_w8a8    the same weights, with an int8 x int8 forward (int8
                  activations; `aqtr.qt.formats.dot_config`).
  float_adam8bit  the float model with `aqtr.qt.adamw_8bit` states.

Every projection kernel is quantized (`aqtr.qt.Rule()`); embeddings and
norms stay float. The optimizer is the job's (clipped AdamW with warmup
and cosine decay), wrapped by `aqtr.qt.quantized_training` for QT runs.

Example:
  >>> SPECS['qt_int8'].weights.kind
  'int8'
"""

from __future__ import annotations

import dataclasses

import aqtr
from aqtr import qt
from aqtr.qt.formats import dot_config

__all__ = ['SPECS', 'RunSpec', 'config']


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """A QT / low-bit-optimizer run.

  Attributes:
    weights: QT weight format, or None for float params.
    activation_bits: 8 for an int8 x int8 forward, None for float.
    adam_bits: 8 for `aqtr.qt.adamw_8bit` states, None for optax.adamw.
  """

  weights: qt.WeightFormat | None = None
  activation_bits: int | None = None
  adam_bits: int | None = None


SPECS = {
  'qt_int8': RunSpec(weights=qt.int8()),
  'qt_int8_w8a8': RunSpec(weights=qt.int8(), activation_bits=8),
  'float_adam8bit': RunSpec(adam_bits=8),
}


def config(spec: RunSpec) -> aqtr.DotGeneralConfig:
  """The DotGeneralConfig injected into the model's weight ops."""
  if spec.weights is None or spec.activation_bits is None:
    return aqtr.presets.float()
  return dot_config(spec.weights, spec.activation_bits)
