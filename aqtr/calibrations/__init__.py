"""Registry `calibrations`: how a scale group's bound is chosen."""

from aqtr.calibrations.absmax import AbsMax
from aqtr.calibrations.base import Calibration, get, names, register, registry
from aqtr.calibrations.constant import Constant
from aqtr.calibrations.minmax import MinMax

__all__ = [
  'AbsMax',
  'Calibration',
  'Constant',
  'MinMax',
  'get',
  'names',
  'register',
  'registry',
]
