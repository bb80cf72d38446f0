"""The job's pieces that need no training: flags, config, tables."""

import dataclasses

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
    ('runs', ('float', 'int9'), 'unknown run'),
    ('runs', 'float', r"runs must be a tuple of run names, e.g. \('float',\)"),
    ('runs', ('int8', 'int8'), 'duplicates'),
    ('task', 'images', 'task must be'),
    ('steps', 0, 'steps must be an int >= 1, got 0'),
    ('steps', 'abc', "steps must be an int >= 1, got 'abc'"),
    ('steps', 2.5, 'steps must be an int >= 1, got 2.5'),
    ('steps', True, 'steps must be an int'),
    ('learning_rate', -1.0, 'learning_rate must be a finite number > 0'),
    ('learning_rate', float('inf'), 'learning_rate must be a finite'),
    ('learning_rate', '1e-3', 'learning_rate must be a finite number'),
    ('grad_clip', 0.0, 'grad_clip must be a finite number > 0'),
    ('weight_decay', -0.1, 'weight_decay must be a finite number >= 0'),
    ('warmup_steps', -1, 'warmup_steps must be an int >= 0'),
    ('seed', -1, 'seed must be an int >= 0'),
    ('val_percent', 100, 'val_percent must be an int in 1..99'),
    ('max_corpus_bytes', 0, 'max_corpus_bytes must be an int >= 1 or None'),
    ('custom', 'int8', 'custom must be a DotGeneralConfig or None'),
    ('model', 3, 'model must be a Fiddle model template or None'),
  ],
)
def test_bad_experiment(field, value, match):
  cfg = experiment.tiny()
  setattr(cfg, field, value)
  with pytest.raises(ValueError, match=match):
    experiment.split(cfg)


def test_every_numeric_field_is_checked():
  numeric = {
    f.name
    for f in dataclasses.fields(experiment.Experiment)
    if f.type in ('int', 'float', 'int | None')
  }
  assert numeric and all(
    _rejects(name, bad) for name in numeric for bad in ('x', -(10**9))
  )
  cfg = experiment.tiny()
  cfg.runs, cfg.learning_rate, cfg.max_corpus_bytes = ['float'], 1, None
  exp = experiment.split(cfg)[0]
  assert exp.runs == ('float',) and exp.learning_rate == 1


def _rejects(name, value):
  try:
    experiment.check_field(name, value)
  except ValueError as e:
    return str(e).startswith(f'{name} must be')
  return False


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
