"""The experiment: float, fp8, naive NVFP4, the recipe and its ablations.

`full()` is the README's run; `small()` the test's reduced size. Both are
`fdl.Config(Ablation)`; override with `--config=set:...`.

Example:
  >>> cfg = small()
  >>> list(cfg.runs)[:4]
  ['float', 'fp8', 'nvfp4_naive', 'nvfp4_recipe']
"""

from __future__ import annotations

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from papers.lib.tasks import Task
from papers.nvfp4_training_recipe.ablation import Ablation, Run

__all__ = ['full', 'runs', 'small']


def _run(preset: str, float_layers=(), **kw) -> fdl.Config:
  return fdl.Config(
    Run,
    config=aqtr_fiddle.config(preset, **kw),
    float_layers=tuple(float_layers),
  )


def runs() -> dict[str, fdl.Config]:
  """The recipe keeps the last layer float; each ablation drops one part."""
  last = (-1,)
  return {
    'float': _run('float'),
    'fp8': _run('fp8'),
    'nvfp4_naive': _run(
      'nvfp4_training',
      rht=False,
      stochastic_rounding=False,
      weight_blocks_2d=False,
    ),
    'nvfp4_recipe': _run('nvfp4_training', last),
    'recipe - RHT': _run('nvfp4_training', last, rht=False),
    'recipe - SR': _run('nvfp4_training', last, stochastic_rounding=False),
    'recipe - 2-D weights': _run(
      'nvfp4_training', last, weight_blocks_2d=False
    ),
    'recipe - float layers': _run('nvfp4_training'),
  }


def full() -> fdl.Config:
  """Teacher 16-32-16 (tanh), student 16-128-128-16, 2000 steps, 2 seeds."""
  task = fdl.Config(
    Task,
    name='teacher',
    hidden=(128, 128),
    teacher_dims=(16, 32, 16),
    train_size=8192,
    steps=2000,
    batch_size=128,
    seeds=(0, 1),
  )
  return fdl.Config(Ablation, task=task, runs=runs())


def small() -> fdl.Config:
  """The test size: 150 steps, one seed, hidden 64."""
  cfg = full()
  cfg.task.hidden, cfg.task.steps, cfg.task.seeds = (64, 64), 150, (0,)
  cfg.task.train_size, cfg.task.val_size = 2048, 512
  return cfg
