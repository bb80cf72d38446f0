"""N:M sparsity: serving bytes of the main job's LM, and its loss gap.

Part 1 (bytes, seconds): the main job's LM (`experiment.default()`:
byte-level transformer, 2 layers, d_model 128) is converted for serving
with every weight op frozen as the main job does it: float32 kernels,
dense int8 (`presets.int8`, 'weights' freezer) and 2:4 + int8
(`presets.int8_sparse_2_4`, 'sparse_weights' freezer: kept int8 values +
2-bit indices packed in uint8). Serving bytes of the weight ops' kernels
(and scales) are reported by `aqtr.flax.sizes`.

Part 2 (loss, minutes): from a short dense warm-up (`--warmup` steps of
dense int8 from the job's init), train `--steps` more steps of dense int8
and of 2:4 + int8 from the same warm-up params, on the same batches, and
report the final train and validation losses and their gap.

  python benchmarks/sparsity.py                       # both parts
  python benchmarks/sparsity.py --bytes-only
  python benchmarks/sparsity.py --warmup 100 --steps 150
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import host
import jax
import numpy as np

import aqtr
import aqtr.flax.linen as ql
from aqtr.train import experiment, loop, models, pax_run, tasks


def _setup(steps: int):
  cfg = experiment.default()
  cfg.steps = steps
  cfg.runs = ('int8',)
  exp, template, _ = experiment.split(cfg)
  return exp, template, tasks.make(exp)


def serving_bytes(template, params, x, config) -> ql.Report:
  """The serving report of the model injected with `config`."""
  injected, _ = models.inject(template, config)
  conv = models.build(models.serving_template(injected, aqtr.Mode.CONVERT))
  variables = jax.jit(lambda p: ql.convert(conv, {'params': p}, x))(params)
  serve = models.build(models.serving_template(injected, aqtr.Mode.SERVE))
  return aqtr.flax.sizes((serve, variables))


def bytes_table(template, task, params) -> list[str]:
  x = np.asarray(next(task.batches())[0])
  rows = []
  reports = {
    name: serving_bytes(template, params, x, cfg)
    for name, cfg in (
      ('int8', aqtr.presets.int8()),
      ('2:4 + int8', aqtr.presets.int8_sparse_2_4()),
    )
  }
  f32 = reports['int8'].float_kernel_bytes
  rows.append(
    '| weight-op kernels | bytes | x float32 | x dense int8 | serving tree |'
  )
  rows.append('|---|---|---|---|---|')
  other = reports['int8'].serving_bytes - reports['int8'].frozen_kernel_bytes
  rows.append(f'| float32 | {f32} | 1.000 | - | {f32 + other} |')
  dense = reports['int8'].frozen_kernel_bytes
  for name, r in reports.items():
    b = r.frozen_kernel_bytes
    rows.append(
      f'| {name} | {b} | {b / f32:.3f} | {b / dense:.3f} | {r.serving_bytes} |'
    )
  return rows


def loss_gap(exp, template, task, warmup: int, steps: int) -> list[str]:
  def run(name, config, n, params=None):
    e = dataclasses.replace(
      exp, steps=n, eval_every=n, log_every=min(n, exp.log_every)
    )
    return pax_run.train(
      name, config, e, task, template, params=params, show_progress=False
    )

  t0 = time.perf_counter()
  warm = run('warmup', aqtr.presets.int8(), warmup)
  rows = [
    f'warm-up: {warmup} steps of dense int8; then {steps} steps each '
    f'(batch {exp.batch_size} x {exp.seq_len} bytes)',
    '',
    '| run | train loss | val loss | val bpc |',
    '|---|---|---|---|',
    f'| warm-up (dense int8) | {warm.train_loss:.4f} | '
    f'{warm.final["val_loss"]:.4f} | {warm.final["bpc"]:.4f} |',
  ]
  finals = {}
  for name, cfg in (
    ('dense int8', aqtr.presets.int8()),
    ('2:4 + int8', aqtr.presets.int8_sparse_2_4()),
  ):
    r = run(name, cfg, steps, warm.params)
    finals[name] = r
    rows.append(
      f'| {name} | {r.train_loss:.4f} | {r.final["val_loss"]:.4f} | '
      f'{r.final["bpc"]:.4f} |'
    )
  a, b = finals['dense int8'], finals['2:4 + int8']
  gap = b.final['val_loss'] - a.final['val_loss']
  rel = gap / a.final['val_loss']
  rows += [
    '',
    f'2:4 gap (val loss, 2:4 - dense): {gap:+.4f} ({100 * rel:+.1f}%); '
    f'train loss gap {b.train_loss - a.train_loss:+.4f}; '
    f'{time.perf_counter() - t0:.0f} s in all',
  ]
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--warmup', type=int, default=100)
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--bytes-only', action='store_true')
  args = p.parse_args(argv)
  print(
    f'# host: {host.cpu_model()}, jax {jax.__version__}, {jax.devices()[0]}'
  )
  exp, template, task = _setup(args.steps)
  params = loop.init_params(template, task, exp.seed)
  print('\n'.join(bytes_table(template, task, params)))
  if not args.bytes_only:
    print()
    print('\n'.join(loss_gap(exp, template, task, args.warmup, args.steps)))


if __name__ == '__main__':
  main()
