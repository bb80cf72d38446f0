"""The experiment: 8- and 4-bit formats on generated data and an MLP.

Formats (`formats.fmts()`, all absmax-scaled): `int8`, `int4` per
channel; `mxfp8` (e4m3) and `mxfp4` (e2m1) in MX blocks of 32; `nvfp4`
(blocks of 16); `nf4` and `int4_g64` (blocks of 64, float32 scales).
Override a format's field with e.g.
`--config="set:formats['nf4'].tiling.tile_size=32"`.

Example:
  >>> cfg = small()
  >>> cfg.shape, cfg.formats['mxfp4'].numerics.element
  ((16, 1024), 'fp4_e2m1')
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from papers.lib import claim
from papers.microscaling_formats.formats import Microscaling, fmts

__all__ = ['full', 'small']


def full() -> fdl.Config:
  """Tensors of 64 x 4096; teacher 64-64-8, student 64-128-128-8, 3 seeds."""
  return fdl.Config(
    Microscaling,
    formats={k: aqtr_fiddle.as_config(v) for k, v in fmts().items()},
    shape=(64, 4096),
    task=claim.teacher(teacher_dims=(64, 64, 8)),
  )


def small() -> fdl.Config:
  """The test size: 16 x 1024 tensors, no int4_g64; one seed, one hidden
  layer of 64, 400 steps."""
  cfg = full()
  cfg.shape = (16, 1024)
  cfg.formats = {k: v for k, v in cfg.formats.items() if k != 'int4_g64'}
  cfg.task.hidden, cfg.task.steps, cfg.task.seeds = (64,), 400, (0,)
  cfg.task.train_size = 4096
  return cfg
