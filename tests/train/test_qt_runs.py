"""The main job's quantized-training runs (aqtr.train.qt_runs), tiny LM."""

import math

import pytest

from aqtr.train import experiment, job, qt_runs


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
  cfg = experiment.tiny()
  cfg.steps, cfg.eval_every, cfg.log_every = 30, 30, 10
  cfg.runs = ('float', 'qt_int8', 'qt_int8_w8a8', 'float_adam8bit')
  out = tmp_path_factory.mktemp('qt_runs')
  got = job.run(cfg, out, show_progress=False, echo=False)
  return {r['run']: r for r in got}


@pytest.mark.slow
def test_runs_learn_and_report_memory(rows):
  assert list(rows) == ['float', 'qt_int8', 'qt_int8_w8a8', 'float_adam8bit']
  for r in rows.values():
    assert r['train loss'] < math.log(256) - 1.0, r
    assert r['param+optimizer MB'] > 0
  f = rows['float']['param+optimizer MB']
  assert rows['qt_int8']['param+optimizer MB'] < f
  assert rows['float_adam8bit']['param+optimizer MB'] <= f


@pytest.mark.slow
def test_w8a8_serves_what_it_trained(rows):
  # The serving conversion re-quantizes the int8 weights to themselves.
  assert rows['qt_int8_w8a8']['serve==train'] is True
  assert rows['qt_int8']['serve==train'] == '-'


def test_unknown_run_lists_qt_runs():
  cfg = experiment.tiny()
  cfg.runs = ('qt_int3',)
  with pytest.raises(ValueError, match='qt_int8_w8a8'):
    experiment.split(cfg)
  assert set(qt_runs.SPECS) == {'qt_int8', 'qt_int8_w8a8', 'float_adam8bit'}
