"""The main job's stateful runs: fp8 delayed scaling and int4 LSQ."""

import math

import pytest

from aqtr.train import experiment, job


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
  cfg = experiment.tiny()
  cfg.steps, cfg.eval_every, cfg.log_every = 12, 12, 6
  cfg.runs = ('fp8_delayed', 'int4_lsq')
  out = tmp_path_factory.mktemp('stateful_runs')
  got = job.run(cfg, out, show_progress=False, echo=False)
  return {r['run']: r for r in got}


@pytest.mark.slow
def test_stateful_runs_train_and_serve_what_they_trained(rows):
  assert list(rows) == ['fp8_delayed', 'int4_lsq']
  for r in rows.values():
    assert r['status'] == 'ok', r
    assert r['train loss'] < math.log(256), r
    assert r['serve==train'] is True, r
