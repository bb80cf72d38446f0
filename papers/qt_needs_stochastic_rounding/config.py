"""The experiment: float vs int8 / int4 weights, nearest vs stochastic.

Runs: `float` (float weights, the usual master copy); `int8_nearest`,
`int8_sr` (int8 per-channel weights, no float copy); `int4_nearest`,
`int4_sr` (int4, one scale per 32 weights). Override with
`--config=set:learning_rates=(1e-3,)` or
`--config="set:runs['int4_sr'].weights.group_size=64"`.

Example:
  >>> cfg = small()
  >>> list(cfg.runs), cfg.runs['int8_sr'].weights.kind
  (['float', 'int8_nearest', 'int8_sr'], 'int8')
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import qt
from papers.lib import claim
from papers.qt_needs_stochastic_rounding.sweep import QtRun, RoundingSweep

__all__ = ['full', 'runs', 'small']


def runs() -> dict[str, fdl.Config]:
  """float, then int8 and int4 weights under each rounding."""
  out = {'float': fdl.Config(QtRun)}
  for kind, group in (('int8', 0), ('int4', 32)):
    for rounding, short in (('nearest', 'nearest'), ('stochastic', 'sr')):
      fmt = fdl.Config(qt.WeightFormat, kind=kind, group_size=group)
      out[f'{kind}_{short}'] = fdl.Config(QtRun, weights=fmt, rounding=rounding)
  return out


def full() -> fdl.Config:
  """digits MLP 64-256-256-10, 1500 Adam steps, lr 1e-3 / 3e-4 / 1e-4."""
  return fdl.Config(
    RoundingSweep,
    runs=runs(),
    learning_rates=(1e-3, 3e-4, 1e-4),
    task=claim.digits(steps=1500, seeds=(0, 1)),
  )


def small() -> fdl.Config:
  """The test size: int8 at lr 1e-3, one hidden layer of 64, 300 steps."""
  cfg = full()
  cfg.runs = {k: cfg.runs[k] for k in ('float', 'int8_nearest', 'int8_sr')}
  cfg.learning_rates = (1e-3,)
  cfg.task.hidden, cfg.task.steps, cfg.task.seeds = (64,), 300, (0,)
  return cfg
