"""Registry `freezers` and the `Mode` enum (train/calibrate/convert/serve).

A freezer decides what one forward operand of a dot stores at CONVERT and
reads at SERVE (`Freezer.freeze`, `Freezer.serve`, returning a `Served`)
and what it collects at CALIBRATE; see `aqtr.freezers.base`.
"""

from aqtr.freezers.base import (
  Freezer,
  Mode,
  NoFreezer,
  Served,
  configure,
  get,
  names,
  register,
  registry,
)
from aqtr.freezers.calibration import CalibrationFreezer
from aqtr.freezers.sparse_weights import SparseWeightsFreezer
from aqtr.freezers.weights import WeightsFreezer

__all__ = [
  'CalibrationFreezer',
  'Freezer',
  'Mode',
  'NoFreezer',
  'Served',
  'SparseWeightsFreezer',
  'WeightsFreezer',
  'configure',
  'get',
  'names',
  'register',
  'registry',
]
