"""High-precision layers: rules by position, recipe runs, the fiddler."""

import pytest

import aqtr
from aqtr.train import cli, experiment, models
from aqtr.train.high_precision import HighPrecision


def _lm(layers=3):
  return models.lm(
    vocab_size=256, seq_len=8, d_model=32, num_layers=layers, num_heads=2
  )


@pytest.mark.parametrize(
  'keep, float_paths',
  [
    (HighPrecision(), []),
    (HighPrecision(head=True), ['softmax.einsum']),
    (HighPrecision(last_blocks=1), ['layers[2]']),
    (
      HighPrecision(first_blocks=1, last_blocks=1, head=True),
      ['layers[0]', 'layers[2]', 'softmax.einsum'],
    ),
  ],
)
def test_lm_blocks_and_head_stay_float(keep, float_paths):
  _, report = models.inject(_lm(), aqtr.presets.nvfp4_training(), keep)
  quantized = report.quantized_paths()
  all_ops = models.inject(_lm(), aqtr.presets.int8())[1].quantized_paths()
  kept = [p for p in all_ops if p not in quantized]
  for prefix in float_paths:
    assert any(p.startswith(prefix) for p in kept), (prefix, kept)
  blocks = {p.split('.')[0] for p in kept if p.startswith('layers')}
  assert len(kept) == 6 * len(blocks) + ('softmax.einsum' in kept)


def test_mlp_head_is_the_last_layer():
  keep = HighPrecision(first_blocks=1, head=True)
  _, report = models.inject(models.mlp(10, (32, 32)), aqtr.presets.int8(), keep)
  assert report.quantized_paths() == ['layers[1].einsum']


def test_recipe_runs_keep_their_layers_and_the_fiddler_overrides():
  cfg = experiment.tiny()
  cfg.runs = ('fp8', 'nvfp4_recipe', 'nvfp4_training')
  exp = experiment.split(cfg)[0]
  assert experiment.kept_float('nvfp4_recipe', exp) == experiment.RECIPE_KEEP
  assert experiment.kept_float('nvfp4_training', exp) is None
  assert experiment.kept_float('custom', exp) is None
  experiment.high_precision(cfg, last_blocks=1)
  exp = experiment.split(cfg)[0]
  assert experiment.kept_float('nvfp4_recipe', exp).label() == 'last 1 block'
  assert experiment.kept_float('custom', exp).last_blocks == 1
  assert experiment.kept_float('fp8', exp) is None
  assert 'high_precision' in cli.fiddler_names()
  for name in experiment.RECIPE_RUNS:
    assert name in experiment.RUNS


def test_bad_input():
  with pytest.raises(
    ValueError, match=r'HighPrecision.last_blocks must be an int >= 0'
  ):
    HighPrecision(last_blocks=-1)
  with pytest.raises(
    ValueError, match=r'HighPrecision.head must be True or False'
  ):
    HighPrecision(head=1)
  with pytest.raises(ValueError, match=r'exceed the model.s 3 blocks'):
    HighPrecision(first_blocks=2, last_blocks=2).rules(_lm())
  with pytest.raises(ValueError, match=r'no `layers` list'):
    HighPrecision(head=True).rules(object())
  cfg = experiment.tiny()
  cfg.high_precision = 'head'
  with pytest.raises(ValueError, match=r'high_precision must be an aqtr.train'):
    experiment.split(cfg)


@pytest.mark.slow
def test_recipe_runs_train_serve_and_generate(tmp_path):
  from aqtr.train import generate, job

  cfg = experiment.tiny()
  cfg.runs, cfg.steps, cfg.sample_tokens = (
    ('nvfp4_recipe', 'mxfp4_recipe'),
    3,
    4,
  )
  experiment.high_precision(cfg, head=True)
  rows = job.run(cfg, tmp_path, show_progress=False, echo=False)
  assert [r['serve==train'] for r in rows] == [True, True]
  served = tmp_path / 'mxfp4_recipe' / 'serving'
  assert (served / 'high_precision.json').is_file()
  assert generate.load(served).model is not None
  assert 'but head (float)' in (tmp_path / 'config.txt').read_text()
