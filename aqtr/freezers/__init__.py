"""Registry `freezers` and the `Mode` enum (train/calibrate/convert/serve)."""

from aqtr.freezers.base import (
  Freezer,
  Mode,
  NoFreezer,
  configure,
  get,
  names,
  register,
  registry,
)
from aqtr.freezers.calibration import CalibrationFreezer
from aqtr.freezers.weights import WeightsFreezer

__all__ = [
  'CalibrationFreezer',
  'Freezer',
  'Mode',
  'NoFreezer',
  'WeightsFreezer',
  'configure',
  'get',
  'names',
  'register',
  'registry',
]
