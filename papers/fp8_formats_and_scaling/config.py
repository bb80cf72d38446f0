"""The experiment: float vs fp8 recipes, scaled and unscaled gradients.

Runs (all with an e4m3 forward, per-channel absmax scaling):
  float            no quantization
  fp8              e4m3 forward, e5m2 gradients, gradients scaled (absmax)
  e4m3_grads       e4m3 gradients, scaled
  e5m2_unscaled    e5m2 gradients, unscaled (scale 1: a plain cast)
  e4m3_unscaled    e4m3 gradients, unscaled (small gradients flush to 0)
  fp8_per_tensor   the fp8 recipe, one dynamic scale per tensor
  fp8_delayed      per tensor, delayed scaling: each scale from the max of
                   the last 16 amax values (Transformer Engine / FP8-LM);
                   the gradients' histories update in the backward pass

"Unscaled" is the `constant` calibration with bound = the format's max
(scale 1). `fp8_per_tensor` is the dynamic twin of `fp8_delayed` (same
tiling), so the two differ only in where the scale comes from.

Example:
  >>> cfg = small()
  >>> cfg.runs['e4m3_unscaled'].drhs.lhs.calibration.bound
  448.0
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr import fiddlers
from papers.lib import claim
from papers.lib.compare import Comparison

__all__ = ['full', 'gradients', 'per_tensor', 'runs', 'small']

GRADIENTS = r'(dlhs|drhs)\.lhs'
MAX = {'float8_e4m3fn': 448.0, 'float8_e5m2': 57344.0}


def gradients(dtype_name: str, scaled: bool) -> fdl.Config:
  """The fp8 preset with its gradient operands in `dtype_name`.

  Args:
    dtype_name: 'float8_e4m3fn' or 'float8_e5m2'.
    scaled: per-channel absmax scaling (True) or a plain cast (False).
  """
  cfg = aqtr_fiddle.config('fp8')
  fiddlers.use_numerics(
    cfg, GRADIENTS, 'fp8', dtype_name=dtype_name, clip_gradient=False
  )
  if not scaled:
    fiddlers.use_calibration(cfg, GRADIENTS, 'constant', bound=MAX[dtype_name])
  return cfg


def runs() -> dict[str, fdl.Config]:
  """float, the fp8 recipe, and the three gradient-format variants."""
  return {
    'float': aqtr_fiddle.config('float'),
    'fp8': aqtr_fiddle.config('fp8'),
    'e4m3_grads': gradients('float8_e4m3fn', scaled=True),
    'e5m2_unscaled': gradients('float8_e5m2', scaled=False),
    'e4m3_unscaled': gradients('float8_e4m3fn', scaled=False),
    'fp8_per_tensor': per_tensor(),
    'fp8_delayed': aqtr_fiddle.config('fp8_delayed'),
  }


def per_tensor() -> fdl.Config:
  """The fp8 recipe with one dynamic (current absmax) scale per tensor."""
  cfg = aqtr_fiddle.config('fp8')
  fiddlers.use_tiling(cfg, r'.*', 'per_tensor')
  return cfg


def full() -> fdl.Config:
  """Teacher-student regression (sensitive) and digits, 3 seeds."""
  return fdl.Config(
    Comparison,
    runs=runs(),
    tasks={'teacher': claim.teacher(), 'digits': claim.digits()},
  )


def small() -> fdl.Config:
  """The test size: teacher only, one seed, one hidden layer, no serving."""
  cfg = full()
  t = cfg.tasks['teacher']
  t.hidden, t.steps, t.seeds, t.train_size = (64,), 600, (0,), 4096
  cfg.tasks, cfg.serve = {'teacher': t}, False
  keep = ('float', 'fp8', 'e4m3_unscaled', 'fp8_per_tensor', 'fp8_delayed')
  cfg.runs = {k: cfg.runs[k] for k in keep}
  return cfg
