"""The experiment: the stock MoE decoder under float and four fp8 recipes.

`full()` is the README's table; `small()` the test's size. Both are
`fdl.Config(Fp8Recipes)`; override with `--config=set:experiment.steps=..`.

Example:
  >>> cfg = small()
  >>> cfg.experiment.runs[:2], cfg.seeds
  (('moe_float', 'moe_maxtext_fp8'), (0,))
"""

from __future__ import annotations

import fiddle as fdl

from aqtr.data import stdlib
from aqtr.train import experiment, models
from papers.fp8_recipes.recipes import RUNS, Fp8Recipes

__all__ = ['full', 'small']


def _lm(d_model: int, num_layers: int, num_heads: int) -> fdl.Config:
  """The template whose sizes the MoE takes (vocab, width, blocks, heads)."""
  return models.lm(
    vocab_size=stdlib.VOCAB_SIZE,
    seq_len=1,  # The job sets the positions to Experiment.seq_len.
    d_model=d_model,
    num_layers=num_layers,
    num_heads=num_heads,
  )


def full() -> fdl.Config:
  """d_model 128, 2 MoE blocks (4 experts, top 2), 150 steps of 8 x 64
  bytes (512 tokens: the 128-token tiles divide every contraction), 3
  seeds."""
  exp = fdl.Config(
    experiment.Experiment,
    model=_lm(128, 2, 4),
    runs=RUNS,
    steps=150,
    batch_size=8,
    seq_len=64,
    learning_rate=3e-3,
    warmup_steps=15,
    eval_every=150,
    eval_batches=8,
    log_every=25,
    sample_tokens=0,
    max_corpus_bytes=1_000_000,
  )
  return fdl.Config(Fp8Recipes, experiment=exp, seeds=(0, 1, 2))


def small() -> fdl.Config:
  """The test size: one block of width 32, 8 steps, 3 runs, one seed."""
  cfg = full()
  e = cfg.experiment
  e.model = _lm(32, 1, 2)
  e.runs = ('moe_float', 'moe_maxtext_fp8', 'moe_deepseek_v3_fp8')
  e.steps, e.batch_size, e.seq_len = 8, 4, 32
  e.eval_batches, e.max_corpus_bytes, e.log_every = 2, 100_000, 4
  e.eval_every = 8
  cfg.seeds = (0,)
  return cfg
