"""Registry `calibrations`: how a scale group's bound is chosen."""

from aqtr.calibrations.absmax import AbsMax
from aqtr.calibrations.base import Calibration, get, names, register, registry
from aqtr.calibrations.constant import Constant
from aqtr.calibrations.minmax import MinMax
from aqtr.calibrations.mse import Mse
from aqtr.calibrations.percentile import Percentile
from aqtr.calibrations.rms import Rms

__all__ = [
  'AbsMax',
  'Calibration',
  'Constant',
  'MinMax',
  'Mse',
  'Percentile',
  'Rms',
  'get',
  'names',
  'register',
  'registry',
]
