"""A run whose loss or parameters become non-finite is reported diverged."""

import json
import math

from aqtr.train import experiment, job, loop, models, report

PNG = b'\x89PNG\r\n\x1a\n'


def test_huge_learning_rate_is_reported_diverged(tmp_path):
  cfg = experiment.digits()
  cfg.model = models.mlp(10, hidden=(16,))
  cfg.steps, cfg.eval_every, cfg.log_every = 12, 100, 100
  cfg.runs, cfg.learning_rate = ('float', 'int8'), 1e30
  rows = job.run(cfg, tmp_path, show_progress=False, echo=False)
  assert [r['run'] for r in rows] == ['float', 'int8']  # int8 still ran.
  for row in rows:
    step = int(row['status'].rsplit(' ', 1)[-1])
    assert row['status'].startswith('non-finite') and step <= loop.CHECK_EVERY
    assert row['train loss'] == 'diverged' and row['serve==train'] == '-'
  summary = (tmp_path / 'summary.md').read_text()
  assert summary.count('diverged') == 2 and 'nan' not in summary.lower()
  records = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').open()]
  assert sum('diverged' in r for r in records) == 2
  assert all(
    math.isfinite(r[k])
    for r in records
    for k in ('train_loss', 'val_loss')
    if k in r
  )
  assert (tmp_path / 'loss.png').read_bytes()[:8] == PNG
  assert not list(tmp_path.rglob(report.INCOMPLETE))
  assert not (tmp_path / 'int8' / 'serving').exists()


def test_plot_skips_non_finite_values(tmp_path):
  nan, inf = float('nan'), float('inf')
  records = [
    {'run': 'float', 'step': 0, 'val_loss': 5.0},
    {'run': 'float', 'step': 5, 'train_loss': 4.0},
    {'run': 'float', 'step': 10, 'val_loss': 3.0},
    {'run': 'int8', 'step': 0, 'val_loss': 5.0},
    {'run': 'int8', 'step': 5, 'train_loss': nan},
    {'run': 'int8', 'step': 10, 'val_loss': inf},
  ]
  path = report.plot(records, tmp_path / 'loss.png', 'title')
  assert path.read_bytes()[:8] == PNG
