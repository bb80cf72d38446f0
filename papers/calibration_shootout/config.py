"""The experiment: the N(0, 1) clip oracle, then W2 / A2 PTQ of digits.

Calibrations (all registered in `aqtr.calibrations`): `absmax`;
`percentile` at q = 99.9 and 99; `mse` (the search); `rms` with p = 2
at c = 2 and 3 (fixed k-sigma clips); the experiment adds `mean_of_max`
for activations. Override with e.g.
`--config="set:calibrations['percentile_99'].q=98.0"` or
`--config=set:bits=3`.

Example:
  >>> cfg = small()
  >>> sorted(cfg.calibrations), cfg.bits
  (['absmax', 'mse'], 2)
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import calibrations
from papers.calibration_shootout.shootout import Shootout
from papers.lib import claim

__all__ = ['full', 'small']


def full() -> fdl.Config:
  """Oracle at 2/3/4/8 bits; digits MLP 64-256-256-10, 3 seeds, 2 bits."""
  return fdl.Config(
    Shootout,
    oracle_bits=(2, 3, 4, 8),
    clips=(0.5, 5.0, 0.005),
    calibrations={
      'absmax': fdl.Config(calibrations.AbsMax),
      'percentile_99.9': fdl.Config(calibrations.Percentile, q=99.9),
      'percentile_99': fdl.Config(calibrations.Percentile, q=99.0),
      'mse': fdl.Config(calibrations.Mse),
      'rms_2sigma': fdl.Config(calibrations.Rms, p=2.0, c=2.0),
      'rms_3sigma': fdl.Config(calibrations.Rms, p=2.0, c=3.0),
    },
    bits=2,
    task=claim.digits(),
  )


def small() -> fdl.Config:
  """The test size: oracle at 2 and 4 bits on a coarse grid; absmax vs
  mse on a one-seed MLP with one hidden layer of 64."""
  cfg = full()
  cfg.oracle_bits, cfg.clips, cfg.samples = (2, 4), (1.0, 3.0, 0.025), 4096
  cfg.calibrations = {k: cfg.calibrations[k] for k in ('absmax', 'mse')}
  cfg.task.hidden, cfg.task.steps, cfg.task.seeds = (64,), 200, (0,)
  return cfg
