"""papers/microscaling_formats at the reduced size: the claim holds."""

import pathlib

import jax.numpy as jnp
import pytest

from aqtr.train import report
from papers.microscaling_formats import config, formats, run

SOURCES = ('gaussian dB', 'student_t3 dB', 'MLP weights dB')


@pytest.fixture(scope='module')
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp('mx')
  rows = run.run(config.small(), out, echo=False)
  return {r['format']: r for r in rows}, out


def test_block_scaled_fp4_beats_mxfp4_beats_int4(result):
  rows, _ = result
  for src in SOURCES:
    best = min(rows['nvfp4'][src], rows['nf4'][src])
    assert best > max(rows['mxfp4'][src], rows['int4'][src]) + 0.5, src
  for src in SOURCES[:2]:  # generated data (the MLP's K is only 64 or 128)
    assert rows['mxfp4'][src] > rows['int4'][src] + 1.0, src


def test_int8_beats_mxfp8_on_gaussian_data(result):
  rows, _ = result
  assert rows['int8']['gaussian dB'] > rows['mxfp8']['gaussian dB'] + 8.0
  # Heavy tails cost int8 far more than mxfp8 (which wins at K = 4096).
  int8_loss = rows['int8']['gaussian dB'] - rows['int8']['student_t3 dB']
  mx_loss = rows['mxfp8']['gaussian dB'] - rows['mxfp8']['student_t3 dB']
  assert int8_loss > mx_loss + 5.0


def test_four_bit_serves_worse_than_int8(result):
  rows, _ = result
  assert rows['int8']['loss / float'] < 1.005
  for f in ('int4', 'mxfp4', 'nvfp4', 'nf4'):
    assert rows[f]['loss / float'] > rows['int8']['loss / float'], f


def test_bits_per_value_count_the_scales():
  f = formats.fmts()
  got = {n: formats.bits_per_value(t, k=4096) for n, t in f.items()}
  assert got['mxfp8'] == 8.25 and got['mxfp4'] == 4.25
  assert got['nvfp4'] == got['nf4'] == got['int4_g64'] == 4.5
  assert got['int8'] == 8 + 32 / 4096


def test_sqnr_is_infinite_on_exact_values():
  x = jnp.array([[1.0, -1.0, 0.0, 1.0] * 16])
  assert formats.sqnr(x, formats.fmts()['int4']) == float('inf')


def test_writes_table_plot_and_config(result):
  rows, out = result
  table = report.parse_table((out / 'results.md').read_text())
  assert [r['format'] for r in table] == list(rows)
  assert (out / 'results.png').read_bytes()[:4] == b'\x89PNG'


def test_bad_shape_is_rejected():
  with pytest.raises(ValueError, match='Microscaling.shape'):
    formats.Microscaling(shape=(4, 100))


def test_readme_states_claim_command_and_numbers():
  text = (pathlib.Path(config.__file__).parent / 'README.md').read_text()
  assert 'python -m papers.microscaling_formats.run' in text
  assert 'results.png' in text and 'arXiv' in text


@pytest.mark.slow
def test_full_size_matches_readme(tmp_path):
  rows = {r['format']: r for r in run.run(config.full(), tmp_path, echo=False)}
  readme = {
    'int8': (41.17, 27.98, 43.91),
    'mxfp8': (30.66, 29.50, 30.73),
    'int4': (16.01, 5.44, 18.69),
    'mxfp4': (18.80, 16.98, 18.84),
    'nvfp4': (20.44, 20.85, 20.49),
    'nf4': (20.73, 18.17, 20.65),
    'int4_g64': (19.35, 14.84, 19.24),
  }
  for f, want in readme.items():
    got = tuple(rows[f][s] for s in SOURCES)
    assert got == pytest.approx(want, abs=0.3), f
  loss = {f: r['loss / float'] for f, r in rows.items()}
  assert max(loss['nvfp4'], loss['nf4']) < loss['mxfp4'] < loss['int4_g64']
  assert loss['int4_g64'] < loss['int4']
  assert loss['int8'] < 1.005 and loss['mxfp8'] < 1.03
  assert rows['mxfp8']['student_t3 dB'] > rows['int8']['student_t3 dB']
