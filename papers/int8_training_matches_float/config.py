"""The experiment: float / int8 / int4 / forward-int2 on digits and teacher.

`full()` is the README's run; `small()` the test's reduced size. Both are
`fdl.Config(Comparison)`: override with `--config=set:...` or add a run
with `--config="fiddler:add_run('int6', 'fully_quantized', 6, 6)"`.

Example:
  >>> cfg = small()
  >>> list(cfg.runs), cfg.runs['int4'].dlhs.lhs.numerics.bits
  (['float', 'int8', 'int4', 'fwd_int2'], 4)
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from papers.lib import claim
from papers.lib.compare import Comparison

__all__ = ['full', 'runs', 'small']


def runs() -> dict[str, fdl.Config]:
  """float; int8 fwd/dlhs/drhs; int4 everywhere; int2 fwd + int8 grads."""
  return {
    'float': aqtr_fiddle.config('float'),
    'int8': aqtr_fiddle.config('int8'),
    'int4': aqtr_fiddle.config('fully_quantized', 4, 4),
    'fwd_int2': aqtr_fiddle.config('fully_quantized', 2, 8),
  }


def full() -> fdl.Config:
  """digits MLP 64-256-256-10 and an 8-32-4 tanh teacher, 3 seeds each."""
  return fdl.Config(
    Comparison,
    runs=runs(),
    tasks={'digits': claim.digits(), 'teacher': claim.teacher()},
  )


def small() -> fdl.Config:
  """The test size: one seed, fewer steps, one hidden layer of 64."""
  cfg = full()
  d, t = cfg.tasks['digits'], cfg.tasks['teacher']
  d.hidden, d.steps, d.seeds = (64,), 200, (0,)
  t.hidden, t.steps, t.seeds = (64,), 2000, (0,)
  return cfg
