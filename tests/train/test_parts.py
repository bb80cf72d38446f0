"""The job's pieces that need no training: flags, config, tables."""

import fiddle as fdl
import pytest

import aqtr
from aqtr.train import experiment, models, report
from aqtr.train.__main__ import with_default_config


def test_default_config_is_inserted_only_when_missing():
  argv = with_default_config(['x', '--config=set:steps=3'])
  assert argv.index('--config=config:default') < argv.index(
    '--config=set:steps=3'
  )
  argv = with_default_config(['x', '--config=config:tiny'])
  assert '--config=config:default' not in argv
  argv = with_default_config(['x', '--config', 'config_file:a.json', '-v=1'])
  assert argv == ['x', '--config', 'config_file:a.json', '-v=1']


def test_split_and_custom():
  cfg = experiment.tiny()
  experiment.custom(cfg, 'fully_quantized', fwd_bits=4, bwd_bits=8)
  cfg.seq_len = 16
  exp, template, custom = experiment.split(cfg)
  assert exp.run_names == ('float', 'int8', 'fp8', 'custom')
  assert custom == aqtr.presets.fully_quantized(4, 8)
  assert template.max_len == 16 and cfg.model.max_len == 1  # Copy.


@pytest.mark.parametrize(
  'field, value, match',
  [
    ('runs', ('float', 'int9'), 'unknown preset'),
    ('task', 'images', 'task must be'),
    ('steps', 0, 'steps must be'),
  ],
)
def test_bad_experiment(field, value, match):
  cfg = experiment.tiny()
  setattr(cfg, field, value)
  with pytest.raises(ValueError, match=match):
    experiment.split(cfg)


def test_injection_quantizes_weights_only():
  cfg, rep = models.inject(experiment.tiny().model, aqtr.presets.int8())
  quantized = rep.quantized_paths()
  assert 'softmax.einsum' in quantized
  assert not any('qk_einsum' in p or 'pv_einsum' in p for p in quantized)
  assert models.has_frozen_weights(cfg)
  float_cfg, rep = models.inject(experiment.tiny().model, None)
  assert not rep.quantized_paths() and not models.has_frozen_weights(float_cfg)
  assert fdl.get_callable(float_cfg).__name__ == 'TransformerLm'


def test_table_round_trip():
  rows = [
    {'run': 'float', 'x': 1.0, 'ok': True},
    {'run': 'int8', 'x': None, 'ok': False},
  ]
  text = report.table(rows, ['run', 'x', 'ok'], {'x': '.2f'})
  assert report.parse_table('intro\n' + text + '\ntail') == [
    {'run': 'float', 'x': '1.00', 'ok': 'yes'},
    {'run': 'int8', 'x': '-', 'ok': 'NO'},
  ]
