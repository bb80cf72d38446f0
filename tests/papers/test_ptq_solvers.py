"""papers/ptq_solvers at the reduced size: the claims' direction holds."""

import pytest

from papers.ptq_solvers import config, run, study


@pytest.fixture(scope='module')
def res(tmp_path_factory):
  out = tmp_path_factory.mktemp('ptq')
  r = run.run(config.small(), out, echo=False)
  assert (out / 'results.md').exists() and (out / 'results.png').exists()
  return r


def _gap(res, grid, method):
  rows = res['weights'] + res['formats']
  return next(
    r['gap'] for r in rows if (r['grid'], r['method']) == (grid, method)
  )


def test_gptq_and_awq_close_most_of_the_3_bit_gap(res):
  rtn = _gap(res, 'w3g32', 'rtn')
  assert rtn > 0.02, rtn  # 3 bits hurt the LM measurably
  for method in ('gptq', 'awq'):
    assert _gap(res, 'w3g32', method) < 0.5 * rtn, (method, res['weights'])


def test_layer_error_below_rtn(res):
  for r in res['weights']:
    if r['method'] == 'gptq':
      rtn = next(
        x
        for x in res['weights']
        if (x['grid'], x['method']) == (r['grid'], 'rtn')
      )
      assert r['error'] < rtn['error'], (r, rtn)


def test_outliers_are_exact_and_smoothing_helps(res):
  sq = {r['run']: r['bpc'] for r in res['smoothquant']}
  base = res['float'][0]['bpc']
  assert sq['float, outliers injected'] == pytest.approx(base, abs=1e-4)
  bad = sq['W8A8 per tensor, RTN'] - base
  good = sq['W8A8 per tensor, SmoothQuant'] - base
  assert abs(good) < bad, sq


def test_w8a8_and_w3g32_rows_are_separate_runs(res):
  """Each row is its own quantized model (no reused params or config).

  At `config:small` the unsmoothed W8A8 row (outliers injected) and the
  w3g32 RTN row agree to 4 decimals (5.3450) by coincidence: 5.345002 vs
  5.344957, their logits differ by more than either differs from float's,
  and each moves with its own setting (outlier factors, grid)."""
  sq = {r['run']: r['bpc'] for r in res['smoothquant']}
  w3 = next(r['bpc'] for r in res['weights'] if r['method'] == 'rtn')
  assert sq['W8A8 per tensor, RTN'] != w3, (sq, w3)
  clean = sq['W8A8 per tensor, RTN (no outliers)']
  base = res['float'][0]['bpc']
  assert clean - base < 0.1 * (w3 - base), (clean, w3, base)


def test_bad_grid_is_one_line():
  with pytest.raises(ValueError, match=r"Study.grids: unknown \['w5'\]"):
    study.Study(grids=('w5',))


@pytest.mark.slow
def test_full_size_meets_the_targets(tmp_path):
  r = run.run(config.full(), tmp_path, echo=False)
  assert study.closed(r['weights'], 'w4g128', 'gptq') >= 0.5
  # AWQ's half is the target it does not meet on this small LM
  # (papers/ptq_solvers/README.md: 25 % when written, 48 % on
  # 2026-11-28); it must still close part of RTN's gap, less than GPTQ.
  awq = study.closed(r['weights'], 'w4g128', 'awq')
  assert 0.2 <= awq < study.closed(r['weights'], 'w4g128', 'gptq')
  assert _gap(r, 'w3g128', 'gptq') <= 0.5 * _gap(r, 'w3g128', 'rtn')
