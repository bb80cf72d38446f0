"""aqtr-train's LoRA runs 'lora' and 'qlora_nf4' (`aqtr.train.lora_job`)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from aqtr.data import stdlib
from aqtr.train import experiment, job, lora_job, models, stock_lm


def _cfg(**kw):
  cfg = experiment.tiny()
  cfg.model = models.lm(
    stdlib.VOCAB_SIZE, 1, d_model=64, num_layers=1, num_heads=2
  )
  cfg.sample_tokens = 0
  for k, v in kw.items():
    setattr(cfg, k, v)
  return cfg


def test_lora_runs_need_a_float_base():
  with pytest.raises(ValueError, match="put 'stock_float' before it") as e:
    experiment.split(_cfg(runs=('lora',)))
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='before it in runs'):
    experiment.split(_cfg(runs=('qlora_nf4', 'stock_float')))
  exp, _, _ = experiment.split(_cfg(runs=('qlora_nf4',), init_from='/x'))
  assert exp.lora_rank == 8 and exp.finetune_family == 'email'
  with pytest.raises(ValueError, match='lora_rank must be an int >= 1'):
    experiment.split(_cfg(runs=('stock_float', 'lora'), lora_rank=0))


def test_qlora_needs_d_model_its_groups_divide():
  cfg = _cfg(runs=('stock_float', 'qlora_nf4'))
  cfg.model = models.lm(
    stdlib.VOCAB_SIZE, 1, d_model=32, num_layers=1, num_heads=2
  )
  with pytest.raises(ValueError, match="groups of 64 inputs but the LM's "):
    experiment.split(cfg)


def test_the_family_is_held_out_of_pretraining():
  corpus = stdlib.load(max_bytes=3_000_000, exclude=(*stdlib.EXCLUDE, 'email'))
  names = corpus.train_files + corpus.val_files
  assert names and not any(n.startswith('email/') for n in names)


def test_qlora_run_from_a_saved_float_base(tmp_path):
  exp, template, _ = experiment.split(
    _cfg(runs=('stock_float', 'qlora_nf4'), steps=3, eval_batches=2)
  )
  model = stock_lm.StockLm(**stock_lm.sizes(template), rngs=nnx.Rngs(3))
  path = lora_job.save_base(model, tmp_path)
  base = lora_job.load_base(str(path), template, seed=0)
  for a, b in zip(
    jax.tree.leaves(nnx.state(model)),
    jax.tree.leaves(nnx.state(base)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  r, serve = lora_job.run('qlora_nf4', exp, base, tmp_path)
  assert serve['serve_equal']
  assert r.step == 3 and np.isfinite(r.final['bpc'])
  info = json.loads((tmp_path / 'lora.json').read_text())
  assert set(info['bpc']) == {'frozen_base', 'qlora_nf4', 'qlora_nf4_merged'}
  assert info['bytes']['ratio_to_full_ft'] < 0.3
  assert r.param_opt_bytes == sum(
    info['bytes'][k] for k in ('adapters', 'optimizer', 'base', 'other')
  )


@pytest.mark.slow
def test_job_pretrains_then_fine_tunes(tmp_path):
  cfg = _cfg(runs=('stock_float', 'lora', 'qlora_nf4'), steps=10)
  rows = job.run(cfg, tmp_path / 'out', show_progress=False, echo=False)
  assert [r['run'] for r in rows] == ['stock_float', 'lora', 'qlora_nf4']
  assert all(r['status'] == 'ok' for r in rows)
  assert rows[1]['serve==train'] and rows[2]['serve==train']
  assert (tmp_path / 'out' / 'stock_float' / lora_job.BASE_DIR).is_dir()
