"""benchmarks/gpu.py: its plan, its tables, and a smoke run end to end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).parents[2] / 'benchmarks'
sys.path.insert(0, str(BENCH))  # The scripts import each other by name.

import gpu  # noqa: E402
import gpu_tables  # noqa: E402


def test_plan_puts_the_targets_rows_first():
  args = gpu.parse_args([])
  reqs = gpu.plan(args)
  head = [(r['row'], tuple(r.get('shape', ()))) for r in reqs[:12]]
  big, mid = (8192,) * 3, (4096,) * 3
  assert head[:6] == [(r, big) for r in gpu.gpu_rows.MAIN]
  assert head[6:] == [(r, mid) for r in gpu.gpu_rows.MAIN]
  assert [r['row'] for r in reqs[12:15]] == ['bf16', 'int8', 'fp8']
  assert {r['kind'] for r in reqs[12:15]} == {'train'}
  assert reqs[15]['row'] == 'aqtr int8_fwd'
  assert tuple(reqs[-1]['shape']) == (16384, 2048, 8192)
  assert len(reqs) == 3 * len(gpu.gpu_rows.ROWS) + 3


def test_parse_args_names_a_bad_row_and_shape(capsys):
  for bad in (['--rows', 'aqtr int9'], ['--shapes', '12x34']):
    with pytest.raises(SystemExit):
      gpu.parse_args(bad)
    err = capsys.readouterr().err
    assert ('--rows' if bad[0] == '--rows' else '--shapes') in err


def _dot(row, ms):
  return {
    'ms': ms,
    'lower_s': 0.1,
    'compile_s': 1.0,
    'gemms': 'x',
    'whiles': 0,
    'big': '0 (0 touch >1)',
  }


def test_tables_ratios_errors_and_files(tmp_path):
  t = gpu_tables.Tables({'device': 'test'})
  shape = [1000, 1000, 1000]
  rows = {}
  for row, res in (
    ('bf16', _dot('bf16', 4.0)),
    ('limit int8', _dot('limit int8', 2.0)),
    ('aqtr int8', _dot('aqtr int8', 5.0)),
    ('aqtr fp8', {'error': 'timed out (budget 5 s) in compile'}),
  ):
    lines = t.add(dict(kind='dot', row=row, shape=shape), res)
    rows[row] = [c.strip() for c in lines[-1].split('|')[1:-1]]
  assert rows['bf16'][:5] == ['bf16', '4.000', '1.5', '1.00', '-']
  assert rows['aqtr int8'][3:5] == ['0.80', '0.40']  # x bf16, x limit
  assert rows['aqtr fp8'][1] == 'timed out (budget 5 s) in compile'
  train = dict(kind='train', row='int8', size={}, calls=2, steps=2)
  res = dict(ms=50.0, lower_s=1, compile_s=9, temp_bytes=2e9, losses=[9, 8])
  line = t.add(train, res)[-1]
  assert '| 50.00 | 20.00 | - |' in line and '9.00, 8.00' in line
  t.write(tmp_path)
  data = json.loads((tmp_path / 'gpu.json').read_text())
  assert len(data['rows']) == 5
  assert (tmp_path / 'gpu.md').read_text().count('### ') == 3


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
  """Three rows and one train step on CPU; then a row past its budget."""
  cmd = [sys.executable, str(BENCH / 'gpu.py'), '--smoke', '--out']
  rows = ['--rows', 'bf16', 'limit int8', 'aqtr int8', '--train-rows']
  subprocess.run([*cmd, str(tmp_path), *rows, 'bf16'], check=True)
  data = json.loads((tmp_path / 'gpu.json').read_text())
  res = {
    (r['request']['kind'], r['request']['row']): r['result']
    for r in data['rows']
  }
  assert len(res) == 4 and all('ms' in r for r in res.values()), res
  for row in ('limit int8', 'aqtr int8'):
    gemms = res['dot', row]['census']['gemms']
    assert [g['types'] for g in gemms] == ['s8 x s8 -> s32'] * 3, gemms
  limit = res['dot', 'limit int8']['census']['gemms']
  assert {g['layout'] for g in limit} == {'K minor: both'}
  assert len(res['train', 'bf16']['losses']) == 5
  assert (tmp_path / 'hlo' / '128x256x192_aqtr_int8.hlo.gz').exists()
  out = tmp_path / 'timeout'
  budget = ['--row-budget', '0.01', '--train-rows']  # No row fits: 10 ms.
  subprocess.run([*cmd, str(out), *rows[:3], *budget], check=True)
  data = json.loads((out / 'gpu.json').read_text())
  errors = [r['result'].get('error', '') for r in data['rows']]
  assert all(e.startswith('timed out') for e in errors), errors


def test_peer_rows_skip_with_the_reason(monkeypatch):
  monkeypatch.setitem(sys.modules, 'qwix', None)
  monkeypatch.setitem(sys.modules, 'qwix._src.core', None)
  monkeypatch.setitem(sys.modules, 'aqt', None)
  monkeypatch.setitem(sys.modules, 'aqt.jax.v2', None)
  d = gpu.gpu_rows.data((32, 64, 32))
  with pytest.raises(gpu.gpu_rows.Skip, match='qwix is not installed'):
    gpu.gpu_rows.make('qwix fp8', d)
  with pytest.raises(gpu.gpu_rows.Skip, match='aqtp'):
    gpu.gpu_rows.make('aqt int8', d)
  f, args = gpu.gpu_rows.make('limit fp8', d)
  dtypes = [str(a.dtype) for a in args]
  assert dtypes == ['float8_e4m3fn'] * 3 + ['float8_e5m2'] * 2 + [
    'float8_e4m3fn'
  ]
  assert [y.shape for y in f(*args)] == [(32, 32), (32, 64), (32, 64)]
