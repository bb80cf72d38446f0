"""A researcher's own calibration, registered by name, and a config using it.

Nothing here is part of aqtr: it shows that a new algorithm is a small
registered frozen dataclass in your own file (this one is a minimal
version of the built-in `percentile`, under its own name). Import it from
the command line with `--import=configs/my_calibration.py`; then the name
'my_percentile' works in the fiddlers:

  python configs/sweep.py --import=configs/my_calibration.py \
    --config=config:int8 \
    --config="fiddler:use_calibration('dlhs.lhs', 'my_percentile', q=99.0)"
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import fiddle as fdl
import jax
import jax.numpy as jnp

import aqtr
from aqtr.calibrations.base import nonfinite_guard


@aqtr.calibrations.register('my_percentile')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Percentile(aqtr.calibrations.Calibration):
  """bound = the q-th percentile of |x| over each scale group.

  Values above the bound are clipped; q=100 is absmax.

  Attributes:
    q: the percentile, in (0, 100].
  """

  q: float = 99.9

  def __post_init__(self):
    if isinstance(self.q, bool) or not isinstance(self.q, int | float):
      raise TypeError(f'Percentile.q must be a float, got {self.q!r}.')
    if not (math.isfinite(self.q) and 0 < self.q <= 100):
      raise ValueError(f'Percentile.q must be in (0, 100], got {self.q}.')

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    b = jnp.percentile(jnp.abs(x), self.q, axis=tuple(axes), keepdims=True)
    return b.astype(x.dtype) + nonfinite_guard(x, axes)


def int8_percentile_gradients() -> fdl.Config:
  """int8, with a 4-bit, stochastically rounded, percentile-calibrated dlhs g.

  The README walkthrough, in Python rather than flags.
  """
  cfg = aqtr.fiddle.config('int8')
  cfg.dlhs.lhs.numerics.bits = 4
  aqtr.fiddlers.use_rounding(cfg, r'dlhs\.lhs', 'stochastic')
  aqtr.fiddlers.use_calibration(cfg, r'dlhs\.lhs', 'my_percentile', q=99.0)
  return cfg
