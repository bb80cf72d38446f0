"""Post-training quantization: calibrate, solve, serve (`aqtr.ptq`).

`quantize(model, rules, calibration_batches, method=...)` runs the float
model on calibration batches (`collect`: streaming `LayerStats` of every
weight op's input), solves each weight on its rule's grid (`methods`:
'rtn', 'gptq' (arXiv 2210.17323); more register into the same registry)
and returns the ordinary serving tree CONVERT makes, holding the solved
weights, plus a `PtqReport` (per layer: relative output error of RTN and
of the method, seconds).

`stats` holds the shared contract: `LayerStats`, and the weight-as-matrix
view (`as_matrix` / `from_matrix`) the solvers work on.
"""

from aqtr.ptq import (  # Registers the methods and the HF fold maps.
  awq,
  fold,
  hf_fold,
  outliers,
  smoothquant,
)
from aqtr.ptq.api import LayerReport, PtqReport, quantize
from aqtr.ptq.awq import Awq
from aqtr.ptq.collect import Collected, Site, collect
from aqtr.ptq.grid import Grid
from aqtr.ptq.methods import Gptq, Method, Rtn, register
from aqtr.ptq.smoothquant import SmoothQuant
from aqtr.ptq.stats import (
  LayerStats,
  as_matrix,
  from_matrix,
  merge,
  output_error,
  relative_error,
)

__all__ = [
  'Awq',
  'Collected',
  'Gptq',
  'Grid',
  'LayerReport',
  'LayerStats',
  'Method',
  'PtqReport',
  'Rtn',
  'Site',
  'SmoothQuant',
  'awq',
  'as_matrix',
  'collect',
  'fold',
  'from_matrix',
  'hf_fold',
  'merge',
  'outliers',
  'output_error',
  'quantize',
  'register',
  'relative_error',
  'smoothquant',
]
