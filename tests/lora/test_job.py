"""aqtr-train's LoRA runs on the Pax LM and the stock LM (`lora_job`)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from aqtr.data import stdlib
from aqtr.train import experiment, job, lora_job, models, runs, stock_lm


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
  with pytest.raises(ValueError, match="put 'float' before it") as e:
    experiment.split(_cfg(runs=('lora',)))
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match="put 'stock_float' before it"):
    experiment.split(_cfg(runs=('float', 'stock_qlora_nf4')))
  with pytest.raises(ValueError, match='before it in runs'):
    experiment.split(_cfg(runs=('qlora_nf4', 'float')))
  exp, _, _ = experiment.split(_cfg(runs=('qlora_nf4',), init_from='/x'))
  assert exp.lora_rank == 8 and exp.finetune_family == 'email'
  with pytest.raises(ValueError, match='lora_rank must be an int >= 1'):
    experiment.split(_cfg(runs=('float', 'lora'), lora_rank=0))


def test_init_from_may_name_a_job_folder(tmp_path):
  (tmp_path / 'float' / lora_job.BASE_DIR).mkdir(parents=True)
  want = runs.get('qlora_nf4').init_from
  got = lora_job.base_path(str(tmp_path), want)
  assert got == str(tmp_path / 'float' / lora_job.BASE_DIR)
  want = runs.get('stock_lora').init_from
  assert lora_job.base_path(str(tmp_path), want) == str(tmp_path)


def test_qlora_needs_d_model_its_groups_divide():
  cfg = _cfg(runs=('float', 'qlora_nf4'))
  cfg.model = models.lm(
    stdlib.VOCAB_SIZE, 1, d_model=32, num_layers=1, num_heads=2
  )
  with pytest.raises(ValueError, match="groups of 64 inputs but the LM's "):
    experiment.split(cfg)


def test_the_family_is_held_out_of_pretraining():
  corpus = stdlib.load(max_bytes=3_000_000, exclude=(*stdlib.EXCLUDE, 'email'))
  names = corpus.train_files + corpus.val_files
  assert names and not any(n.startswith('email/') for n in names)


@pytest.mark.slow  # ~20 s; the Pax run below covers the same job path.
def test_stock_qlora_run_from_a_saved_float_base(tmp_path):
  exp, template, _ = experiment.split(
    _cfg(runs=('stock_float', 'stock_qlora_nf4'), steps=3, eval_batches=2)
  )
  model = stock_lm.StockLm(**stock_lm.sizes(template), rngs=nnx.Rngs(3))
  path = lora_job.save_base(model, tmp_path)
  base = lora_job.load_base(str(path), template, 0, stock=True)
  for a, b in zip(
    jax.tree.leaves(nnx.state(model)),
    jax.tree.leaves(nnx.state(base)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  r, serve = lora_job.run(runs.get('stock_qlora_nf4'), exp, base, tmp_path)
  assert serve['serve_equal']
  assert r.step == 3 and np.isfinite(r.final['bpc'])
  info = json.loads((tmp_path / 'lora.json').read_text())
  assert set(info['bpc']) == {
    'frozen_base',
    'stock_qlora_nf4',
    'stock_qlora_nf4_merged_rtn',
    'stock_qlora_nf4_merged_gptq',
  }
  assert info['bytes']['ratio_to_full_ft'] < 0.3
  assert r.param_opt_bytes == sum(
    info['bytes'][k] for k in ('adapters', 'optimizer', 'base', 'other')
  )


def test_qlora_run_on_the_pax_lm_from_saved_float_params(tmp_path):
  exp, template, _ = experiment.split(
    _cfg(runs=('float', 'qlora_nf4'), steps=3, eval_batches=2, ptq_batches=2)
  )
  x = jax.numpy.zeros((1, 2), int)
  params = jax.jit(models.build(template).init)(jax.random.key(5), x)['params']
  path = lora_job.save_base(params, tmp_path)
  base = lora_job.load_base(str(path), template, 0)
  jax.tree.map(np.testing.assert_array_equal, params, base)
  run = runs.get('qlora_nf4')
  r, serve = lora_job.run(run, exp, base, tmp_path, template=template)
  assert serve['serve_equal']
  assert r.step == 3 and np.isfinite(r.final['bpc'])
  info = json.loads((tmp_path / 'lora.json').read_text())
  assert info['model'] == 'Pax LM'
  assert set(info['bpc']) == {
    'frozen_base',
    'qlora_nf4',
    'qlora_nf4_merged_rtn',
    'qlora_nf4_merged_gptq',
  }
  assert info['bytes']['base'] < info['bytes']['base_float'] / 6
  assert r.param_opt_bytes == sum(
    info['bytes'][k] for k in ('adapters', 'optimizer', 'base', 'other')
  )


@pytest.mark.slow
def test_job_pretrains_then_fine_tunes(tmp_path):
  names = ('float', 'lora', 'qlora_nf4', 'stock_float', 'stock_lora')
  cfg = _cfg(runs=names, steps=10)
  rows = job.run(cfg, tmp_path / 'out', show_progress=False, echo=False)
  assert [r['run'] for r in rows] == list(names)
  assert all(r['status'] == 'ok' for r in rows)
  assert all(r['serve==train'] for r in rows if 'lora' in r['run'])
  for base in ('float', 'stock_float'):
    assert (tmp_path / 'out' / base / lora_job.BASE_DIR).is_dir()
