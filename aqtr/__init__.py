"""aqtr: accurate quantized training and serving for JAX.

Example:
  >>> import jax.numpy as jnp, aqtr
  >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  >>> aqtr.einsum('mk,kn->mn', x, w, config=aqtr.presets.int8()).shape
  (4, 2)
"""

from aqtr import (
  calibrations,
  fiddle,
  fiddlers,
  freezers,
  numerics,
  presets,
  selectors,
  sparsity,
  state,
  tags,
  tilings,
  transforms,
  validation,
)
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.conv import conv_general_dilated
from aqtr.core.dimension_numbers import RAGGED
from aqtr.core.dot_general import dot_general
from aqtr.core.einsum import einsum
from aqtr.core.operand import quantize_operand
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import fake_quant, quantize
from aqtr.core.ragged_dot import ragged_dot
from aqtr.core.registry import Registry, UnknownNameError
from aqtr.core.rounding import NearestEven, Rounding, Stochastic
from aqtr.freezers import Mode

__version__ = '0.1.0'

__all__ = [
  'DotGeneralConfig',
  'DotGeneralRaw',
  'Mode',
  'NearestEven',
  'QTensor',
  'RAGGED',
  'Registry',
  'Rounding',
  'Stochastic',
  'TensorConfig',
  'UnknownNameError',
  'calibrations',
  'conv_general_dilated',
  'dot_general',
  'einsum',
  'fake_quant',
  'fiddle',
  'fiddlers',
  'freezers',
  'numerics',
  'presets',
  'quantize',
  'quantize_operand',
  'ragged_dot',
  'selectors',
  'sparsity',
  'state',
  'tags',
  'tilings',
  'transforms',
  'validation',
]
