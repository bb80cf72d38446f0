"""papers/calibration_shootout at the reduced size: the claim holds."""

import pathlib

import pytest

from aqtr.train import report
from papers.calibration_shootout import config, run, shootout


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('cal')
  oracle, ptq = run.run(config.small(), out, echo=False)
  return oracle, {r['calibration']: r for r in ptq}, out


def test_oracle_clip_grows_with_bits_as_expected(result):
  oracle, _, _ = result
  got = {r['bits']: r['oracle clip / sigma'] for r in oracle}
  assert got[2] == pytest.approx(1.22, abs=0.05)
  assert got[4] == pytest.approx(2.47, abs=0.05)


def test_mse_calibration_finds_the_oracle(result):
  oracle, _, _ = result
  for r in oracle:
    assert r['mse calibration / sigma'] == pytest.approx(
      r['oracle clip / sigma'], abs=0.15
    )


def test_mse_beats_absmax_at_two_bit_weights(result):
  _, ptq, _ = result
  assert ptq['mse']['W2'] >= ptq['absmax']['W2'] + 10.0
  assert ptq['mse']['A2'] > ptq['absmax']['A2']


def test_writes_tables_plot_and_config(result):
  _, ptq, out = result
  text = (out / 'results.md').read_text()
  first, second = text.split('\n\n')
  assert len(report.parse_table(first)) == 2
  assert [r['calibration'] for r in report.parse_table(second)] == list(ptq)
  assert (out / 'results.png').read_bytes()[:4] == b'\x89PNG'


def test_bad_fields_are_rejected():
  with pytest.raises(ValueError, match='Shootout.bits must be in 2..8'):
    shootout.Shootout(bits=1)
  with pytest.raises(ValueError, match="'mean_of_max' is added"):
    shootout.Shootout(calibrations={'mean_of_max': None})


def test_readme_states_claim_command_and_numbers():
  text = (pathlib.Path(config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.calibration_shootout.run' in text
  assert 'results.png' in text and 'arXiv' in text


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  oracle, ptq = run.run(config.full(), tmp_path, echo=False)
  expected = {2: 1.22, 3: 1.95, 4: 2.47, 8: 3.94}
  for r in oracle:
    assert r['oracle clip / sigma'] == pytest.approx(
      expected[r['bits']], abs=0.05
    )
    assert r['mse calibration / sigma'] == pytest.approx(
      r['oracle clip / sigma'], abs=0.1
    )
  p = {r['calibration']: r for r in ptq}
  quantized = [k for k in p if k not in ('float', 'mean_of_max')]
  assert p['mse']['W2'] >= p['absmax']['W2'] + 25.0
  assert p['mse']['W2'] == max(p[k]['W2'] for k in quantized)
  best_a = min(p['mse']['A2'], p['rms_2sigma']['A2'])
  assert best_a >= p['percentile_99']['A2'] >= p['absmax']['A2'] + 2.0
  assert p['mean_of_max']['A2'] == min(p[k]['A2'] for k in p)
