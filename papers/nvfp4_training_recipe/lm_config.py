"""The LM ablation's experiment: `aqtr-train` runs of a 4-block byte LM.

`full()` is the README's table; `small()` the test's size. Both are
`fdl.Config(LmAblation)`; override with `--config=set:experiment.steps=..`.

Example:
  >>> cfg = small()
  >>> cfg.experiment.runs[:2], cfg.seeds
  (('float', 'nvfp4_naive'), (0,))
"""

from __future__ import annotations

import fiddle as fdl

from aqtr.data import stdlib
from aqtr.train import experiment, models
from papers.nvfp4_training_recipe.lm_ablation import RUNS, LmAblation

__all__ = ['full', 'small']


def _lm(d_model: int, num_layers: int, num_heads: int) -> fdl.Config:
  return models.lm(
    vocab_size=stdlib.VOCAB_SIZE,
    seq_len=1,  # The job sets the positions to Experiment.seq_len.
    d_model=d_model,
    num_layers=num_layers,
    num_heads=num_heads,
  )


def full() -> fdl.Config:
  """d_model 64, 4 blocks, 400 steps of 16 x 64 bytes, 2 seeds."""
  exp = fdl.Config(
    experiment.Experiment,
    model=_lm(64, 4, 4),
    runs=RUNS,
    steps=400,
    batch_size=16,
    seq_len=64,
    learning_rate=3e-3,
    warmup_steps=20,
    eval_every=100,
    eval_batches=8,
    log_every=20,
    sample_tokens=0,
  )
  return fdl.Config(LmAblation, experiment=exp, seeds=(0, 1))


def small() -> fdl.Config:
  """The test size: 2 blocks of width 32, 12 steps, 3 runs, one seed."""
  cfg = full()
  e = cfg.experiment
  e.model = _lm(32, 2, 2)
  e.runs = ('float', 'nvfp4_naive', 'nvfp4_recipe')
  e.steps, e.batch_size, e.seq_len, e.eval_every = 12, 4, 32, 12
  e.eval_batches, e.max_corpus_bytes = 2, 100_000
  cfg.seeds = (0,)
  return cfg
