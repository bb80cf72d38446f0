"""Post-training quantization solvers (GPTQ, RTN; AWQ and SmoothQuant).

`stats` holds the shared contract: the streaming `LayerStats` of a weight
op's input and the weight-as-matrix view the solvers work on.
"""

from aqtr.ptq.stats import (
  LayerStats,
  as_matrix,
  from_matrix,
  merge,
  output_error,
  relative_error,
)

__all__ = [
  'LayerStats',
  'as_matrix',
  'from_matrix',
  'merge',
  'output_error',
  'relative_error',
]
