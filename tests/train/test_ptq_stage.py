"""The `ptq` stage of aqtr-train (tiny size): rows, reports, bad fields."""

import math

import pytest

from aqtr.train import cli, experiment, job

DIRECTIVES = [
  'config:tiny',
  "set:runs=('float',)",
  'set:steps=10',
  'set:eval_every=10',
  'set:eval_batches=2',
  'set:sample_tokens=0',
  "set:ptq=('rtn', 'gptq')",
  "set:ptq_formats=('w4', 'w3g128')",  # g128: d_model 32 cannot
  'set:ptq_batches=4',
]


def test_ptq_rows_follow_the_float_run(tmp_path):
  cfg = cli.config_from_directives(DIRECTIVES)
  rows = {
    r['run']: r for r in job.run(cfg, tmp_path, show_progress=False, echo=False)
  }
  assert list(rows) == [
    'float',
    'ptq:rtn:w4',
    'ptq:gptq:w4',
    'ptq:rtn:w3g128',
    'ptq:gptq:w3g128',
  ]
  for name in ('ptq:rtn:w4', 'ptq:gptq:w4'):
    assert rows[name]['status'] == 'ok'
    assert math.isfinite(rows[name]['bpc'])
    assert rows[name]['serving KB'] < rows['float']['serving KB']
  assert 'tile_size=128 does not divide' in rows['ptq:rtn:w3g128']['status']
  text = (tmp_path / 'ptq' / 'gptq_w4.txt').read_text()
  assert 'layers_0/ffn/wo/einsum' in text and 'gptq err' in text


def test_bad_ptq_fields_are_one_line():
  cfg = experiment.tiny()
  cfg.ptq = ('obq',)
  with pytest.raises(ValueError, match=r'ptq must be a tuple of names in'):
    experiment.split(cfg)
  cfg.ptq, cfg.ptq_formats = ('gptq',), ('w5',)
  with pytest.raises(ValueError, match='ptq_formats must be'):
    experiment.split(cfg)
  cfg.ptq_formats, cfg.runs = ('w4',), ('int8',)
  with pytest.raises(ValueError, match="add 'float' to runs"):
    experiment.split(cfg)
