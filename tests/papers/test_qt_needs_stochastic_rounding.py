"""papers/qt_needs_stochastic_rounding at the reduced size: the claim holds."""

import pathlib

import pytest

from aqtr.train import report
from papers.qt_needs_stochastic_rounding import config, run, sweep


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('qt')
  rows = run.run(config.small(), out, echo=False)
  return {r['run']: r for r in rows}, out


def test_stochastic_rounding_tracks_float(result):
  rows, _ = result
  assert abs(rows['int8_sr']['lr 0.001'] - rows['float']['lr 0.001']) <= 2.0


def test_nearest_rounding_stalls(result):
  rows, _ = result
  assert rows['float']['lr 0.001'] - rows['int8_nearest']['lr 0.001'] >= 30.0


def test_int8_weights_take_a_quarter_of_the_bytes(result):
  rows, _ = result
  assert rows['int8_sr']['params KB'] < 0.3 * rows['float']['params KB']


def test_writes_table_plot_and_config(result):
  rows, out = result
  table = report.parse_table((out / 'results.md').read_text())
  assert [r['run'] for r in table] == list(rows)
  assert (out / 'results.png').read_bytes()[:4] == b'\x89PNG'
  assert 'learning_rates' in (out / 'config.txt').read_text()


def test_bad_rounding_is_rejected():
  with pytest.raises(ValueError, match='QtRun.rounding must be one of'):
    sweep.QtRun(rounding='up')


def test_readme_states_claim_command_and_numbers():
  text = (pathlib.Path(config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.qt_needs_stochastic_rounding.run' in text
  assert 'results.png' in text and 'arXiv' in text


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  rows = {r['run']: r for r in run.run(config.full(), tmp_path, echo=False)}
  lrs = ('lr 0.001', 'lr 0.0003', 'lr 0.0001')
  for lr in lrs:
    assert abs(rows['int8_sr'][lr] - rows['float'][lr]) <= 1.0, lr
    assert abs(rows['int4_sr'][lr] - rows['float'][lr]) <= 1.0, lr
    assert rows['int4_nearest'][lr] < rows['float'][lr] - 3.0, lr
  assert rows['float']['lr 0.0001'] - rows['int8_nearest']['lr 0.0001'] >= 30
  near = [rows['int8_nearest'][lr] for lr in lrs]
  assert near[0] > near[1] > near[2]
