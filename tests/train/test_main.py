"""`python -m aqtr.train` end to end at the tiny setting, in a subprocess.

One run of the command (float and int8 on the tiny stdlib byte LM, 40
steps) feeds every test here: outputs, summary, serving, and the int8 vs
float tolerance.
"""

import json
import math
import os
import struct
import subprocess
import sys

import pytest

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report

# int8 (fwd + both gradients) ends this close to float on the tiny LM
# (40 steps, same init and batches): final losses in nats.
TOL_TRAIN = 0.05
TOL_VAL = 0.1


@pytest.fixture(scope='module')
def job(tmp_path_factory):
  out = tmp_path_factory.mktemp('train')
  cmd = [
    sys.executable,
    '-m',
    'aqtr.train',
    '--config=config:tiny',
    "--config=set:runs=('float', 'int8')",
    f'--out_dir={out}',
    '--noprogress',
  ]
  # One device, as users run it (fast compiles, see tests/conftest.py).
  env = dict(os.environ, XLA_FLAGS=os.environ.get('AQTR_TEST_XLA_FLAGS', ''))
  proc = subprocess.run(
    cmd, capture_output=True, text=True, timeout=300, env=env
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return out, proc.stdout


def test_metrics_file(job):
  out, _ = job
  records = [
    json.loads(line)
    for line in (out / 'metrics.jsonl').read_text().splitlines()
  ]
  for run in ('float', 'int8'):
    train = [r for r in records if r['run'] == run and 'train_loss' in r]
    evals = [r for r in records if r['run'] == run and 'val_loss' in r]
    assert [r['step'] for r in train] == list(range(5, 41, 5))
    assert [r['step'] for r in evals] == [0, 20, 40]
    assert all(math.isfinite(r['train_loss']) for r in train)
    assert all(r['steps_per_s'] > 0 for r in train)
    assert all('bpc' in r for r in evals)


def test_plot_is_a_png(job):
  out, _ = job
  data = (out / 'loss.png').read_bytes()
  assert data[:8] == b'\x89PNG\r\n\x1a\n' and data[12:16] == b'IHDR'
  width, height = struct.unpack('>II', data[16:24])
  assert width >= 400 and height >= 200
  assert data.rstrip()[-8:-4] == b'IEND'


def test_config_written(job):
  out, _ = job
  text = (out / 'config.txt').read_text()
  assert 'steps = 40\n' in text and 'model: TransformerLm' in text
  assert "# run 'int8'" in text and 'fwd.lhs.numerics.bits = 8' in text
  import aqtr

  cfg = aqtr.fiddle.loads((out / 'config.json').read_text())
  assert cfg.steps == 40 and cfg.runs == ('float', 'int8')


def test_serving_checkpoint(job):
  out, _ = job
  ckpt = out / 'int8' / 'serving'
  assert (ckpt / 'config.json').is_file()
  assert (ckpt / 'variables' / '_METADATA').is_file()
  info = json.loads((out / 'int8' / 'serving.json').read_text())
  assert info['serve_equal'] and info['max_abs_diff'] == 0.0
  assert info['kernel_ratio'] < 0.3
  assert info['serving_bytes'] < info['float_bytes']
  assert not (out / 'float' / 'serving').exists()
  assert 'int8' in (out / 'int8' / 'injection.txt').read_text()


def test_summary_parses(job):
  out, stdout = job
  rows = report.parse_table(stdout[stdout.index('| run') :])
  assert [r['run'] for r in rows] == ['float', 'int8']
  float_row, int8_row = rows
  assert float(float_row['x float']) == 1.0
  assert float(int8_row['steps/s']) > 0 and float(int8_row['compile s']) > 0
  assert int8_row['serve==train'] == 'yes'
  assert float(int8_row['serving KB']) < float(float_row['serving KB'])
  saved = json.loads((out / 'summary.json').read_text())
  assert [r['run'] for r in saved] == ['float', 'int8']
  summary = (out / 'summary.md').read_text()
  assert summary.startswith('| run')
  assert "## Samples (prompt 'def __init__(self'" in summary
  assert '- int8 (serving checkpoint), greedy: ' in summary
  assert '- float (training model), T=0.8 top-k 20, seed 1: ' in summary
  assert (out / 'int8' / 'serving' / 'model.json').is_file()


def test_int8_within_tolerance_of_float(job):
  out, _ = job
  rows = {r['run']: r for r in json.loads((out / 'summary.json').read_text())}
  f, q = rows['float'], rows['int8']
  start = math.log(256)
  assert f['train loss'] < start - 2.0, 'float did not learn'
  assert q['train loss'] < start - 2.0, 'int8 did not learn'
  assert abs(q['train loss'] - f['train loss']) < TOL_TRAIN
  assert abs(q['val loss'] - f['val loss']) < TOL_VAL


def test_quantized_kv_cache_bpc_close_to_float_cache(job):
  # Teacher-forced validation bpc read through the cache, from the int8
  # run's serving checkpoint (tiny size: loose bounds; README's table has
  # the default experiment's numbers).
  from aqtr.pax import KVCacheConfig
  from aqtr.train import experiment, generate, tasks

  out, _ = job
  served = generate.load(out / 'int8' / 'serving')
  cfg = aqtr_fiddle.loads((out / 'config.json').read_text())
  eval_set = tasks.make(experiment.split(cfg)[0]).eval_set

  def bpc(**kw):
    kv = KVCacheConfig(**kw)
    return generate.cache_bpc(served.model, served.variables, eval_set, kv)

  base = bpc()
  rows = {r['run']: r for r in json.loads((out / 'summary.json').read_text())}
  assert abs(base - rows['int8']['bpc']) < 1e-4  # float cache == forward
  assert abs(bpc(numerics='int8') / base - 1) < 0.005
  assert abs(bpc(numerics='fp8') / base - 1) < 0.01
  assert abs(bpc(numerics='int4', scales='block') / base - 1) < 0.05
