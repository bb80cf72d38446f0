"""papers/int8_training_matches_float at the reduced size: the claim holds."""

import pathlib

import pytest

from aqtr.train import report
from papers.int8_training_matches_float import config, run


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('int8')
  rows = run.run(config.small(), out, echo=False)
  return {r['run']: r for r in rows}, out


def test_int8_trains_to_float_quality(result):
  rows, _ = result
  assert abs(rows['int8']['digits'] - rows['float']['digits']) <= 1.0
  assert rows['int8']['teacher'] / rows['float']['teacher'] < 1.1


def test_int4_is_measurably_worse_on_the_regression(result):
  rows, _ = result
  assert rows['int4']['teacher'] / rows['float']['teacher'] > 1.3


def test_forward_int2_loses_at_least_3_points(result):
  rows, _ = result
  assert rows['float']['digits'] - rows['fwd_int2']['digits'] >= 3.0


def test_serve_equals_train_bit_for_bit(result):
  rows, _ = result
  assert all(r['serve==train'] is True for r in rows.values())
  assert rows['int8']['serve KB'] < 0.3 * rows['float']['serve KB']


def test_writes_table_plot_and_config(result):
  rows, out = result
  table = report.parse_table((out / 'results.md').read_text())
  assert [r['run'] for r in table] == list(rows)
  assert (out / 'results.png').read_bytes()[:4] == b'\x89PNG'
  assert 'tasks' in (out / 'config.txt').read_text()


def test_readme_states_claim_command_and_numbers():
  text = (pathlib.Path(config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.int8_training_matches_float.run' in text
  assert 'results.png' in text and 'arXiv' in text


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  rows = {r['run']: r for r in run.run(config.full(), tmp_path, echo=False)}
  assert abs(rows['int8']['digits'] - rows['float']['digits']) <= 0.5
  assert 0.95 < rows['int8']['teacher'] / rows['float']['teacher'] < 1.05
  assert 2.0 < rows['int4']['teacher'] / rows['float']['teacher'] < 3.5
  assert rows['float']['digits'] - rows['fwd_int2']['digits'] >= 5.0
  assert all(r['serve==train'] is True for r in rows.values())
