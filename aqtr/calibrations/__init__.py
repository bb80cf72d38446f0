"""Registry `calibrations`: how a scale group's bound is chosen."""

from aqtr.calibrations.absmax import AbsMax
from aqtr.calibrations.base import (
  Calibration,
  StatefulCalibration,
  get,
  names,
  register,
  registry,
)
from aqtr.calibrations.constant import Constant
from aqtr.calibrations.delayed_scaling import DelayedScaling
from aqtr.calibrations.ema_stats import EmaStats, MeanAbsMax
from aqtr.calibrations.lsq import Lsq
from aqtr.calibrations.minmax import MinMax
from aqtr.calibrations.mse import Mse
from aqtr.calibrations.pact import Pact
from aqtr.calibrations.percentile import Percentile
from aqtr.calibrations.rms import Rms

__all__ = [
  'AbsMax',
  'Calibration',
  'Constant',
  'MinMax',
  'DelayedScaling',
  'EmaStats',
  'Lsq',
  'MeanAbsMax',
  'Mse',
  'Pact',
  'StatefulCalibration',
  'Percentile',
  'Rms',
  'get',
  'names',
  'register',
  'registry',
]
