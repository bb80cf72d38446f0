"""Quantized training without a float master copy, and low-bit optimizers.

Needs the `flax` extra (optax): `pip install 'aqtr[flax]'`. `import aqtr`
does not import this package.

  formats: WeightFormat (int8 per-channel, int4 group-wise, fp8 e4m3).
  params: QTParam leaves chosen by path Rules; quantize / dequantize.
  training: quantized_training(inner optax transformation), apply_updates.
  lowbit / adam: adamw_8bit (Dettmers et al. 2022, arXiv 2110.02861) and
    adamw_4bit (Li et al. 2023, arXiv 2309.01507), both lowbit_adamw with
    a pair of StateCodecs.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from aqtr import qt
  >>> params, report = qt.quantize_params({'kernel': jnp.ones((64, 4))})
  >>> tx = qt.quantized_training(qt.adamw_8bit(1e-3))
  >>> state = tx.init(params)
"""

from aqtr.qt.adam import (
  adamw_4bit,
  adamw_8bit,
  lowbit_adamw,
  scale_by_lowbit_adam,
)
from aqtr.qt.formats import WeightFormat, fp8, int4, int8
from aqtr.qt.lowbit import StateCodec
from aqtr.qt.params import (
  QTParam,
  QuantizationReport,
  Rule,
  dequantize,
  quantize_params,
  requantize,
  tree_bytes,
)
from aqtr.qt.training import (
  NearestRoundingWarning,
  QTState,
  apply_updates,
  quantized_training,
  step_key,
)

__all__ = [
  'NearestRoundingWarning',
  'QTParam',
  'QTState',
  'QuantizationReport',
  'Rule',
  'StateCodec',
  'WeightFormat',
  'adamw_4bit',
  'adamw_8bit',
  'apply_updates',
  'dequantize',
  'fp8',
  'int4',
  'int8',
  'lowbit_adamw',
  'quantize_params',
  'quantized_training',
  'requantize',
  'scale_by_lowbit_adam',
  'step_key',
  'tree_bytes',
]
