"""The experiment: the main job's byte LM in float, then every PTQ method.

`full()`: the default `aqtr-train` LM (2 blocks, d_model 128, 16 x 64
bytes per step) trained 3000 float Adam steps (cosine decay to zero;
validation bpc still falls 0.02 per 250 steps at the end: see
results.md's curve), 16 calibration batches. `small()`: the toy LM
of the tests.

Example:
  >>> cfg = small()
  >>> cfg.lm.steps, cfg.grids
  (120, ('w3g32',))
"""

from __future__ import annotations

import fiddle as fdl

from aqtr.train import experiment
from papers.ptq_solvers.study import Study

__all__ = ['full', 'small']


def full() -> fdl.Config:
  """The default LM, 3000 float steps; every grid, method and format."""
  lm = experiment.default()
  lm.steps, lm.eval_every, lm.runs = 3000, 250, ('float',)
  return fdl.Config(Study, lm=lm)


def small() -> fdl.Config:
  """The tests' size: the tiny LM, one grid, three methods."""
  lm = experiment.tiny()
  lm.steps, lm.runs = 120, ('float',)
  return fdl.Config(
    Study,
    lm=lm,
    calibration_batches=2,
    grids=('w3g32',),
    methods=('rtn', 'gptq', 'awq'),
    formats=(),
  )
