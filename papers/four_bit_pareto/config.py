"""The experiment: equal-bytes width sweep of a digits MLP at 4, 8, 16 bits.

A run with `bits[name]` bits per weight gets hidden width
`w * 8 // bits[name]` for each 8-bit width `w` of `widths`, so the three
precisions meet at the same weight bytes (weights: 64 w + 10 w). bf16 is
the float model counted at 2 bytes per weight.

Example:
  >>> cfg = small()
  >>> cfg.widths, cfg.bits['int4']
  ((4,), 4)
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from papers.four_bit_pareto.sweep import Pareto
from papers.lib import claim

__all__ = ['full', 'small']


def full() -> fdl.Config:
  """8-bit widths 2..64 (int4 4..128, bf16 1..32), 3 seeds."""
  return fdl.Config(
    Pareto,
    runs={
      'bf16': aqtr_fiddle.config('float'),
      'int8': aqtr_fiddle.config('fully_quantized', 8, None),
      'int4': aqtr_fiddle.config('fully_quantized', 4, None),
    },
    bits={'bf16': 16, 'int8': 8, 'int4': 4},
    widths=(2, 4, 8, 16, 32, 64),
    task=claim.digits(steps=400, learning_rate=1e-2),
  )


def small() -> fdl.Config:
  """The test size: one budget (8-bit width 4), one seed."""
  cfg = full()
  cfg.widths, cfg.task.seeds, cfg.task.steps = (4,), (0,), 300
  return cfg
