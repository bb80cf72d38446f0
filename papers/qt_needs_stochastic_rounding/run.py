"""Trains float / int8 / int4 weights (nearest vs stochastic rounding).

  python -m papers.qt_needs_stochastic_rounding.run
  python -m papers.qt_needs_stochastic_rounding.run --config=config:small \
    --out_dir=/tmp/qt

Writes results.md (accuracy per learning rate), results.png (accuracy
against learning rate; loss curves at the smallest) and config.txt to
--out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl
import numpy as np

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.lib import claim, cli, plots
from papers.qt_needs_stochastic_rounding import config, sweep

__all__ = ['main', 'plot', 'run']


def plot(
  exp: sweep.RoundingSweep,
  rows: list[dict[str, Any]],
  curves: dict[tuple[str, str], np.ndarray],
  path: pathlib.Path,
) -> pathlib.Path:
  """Accuracy against learning rate; train loss at the smallest rate."""
  plt = plots.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
  lrs = exp.learning_rates
  last = exp.column(min(lrs))
  for r in rows:
    style = '--' if 'nearest' in r['weights'] else '-'
    a.errorbar(
      lrs,
      [r[exp.column(lr)] for lr in lrs],
      yerr=[r[f'sd {lr:g}'] for lr in lrs],
      marker='o',
      capsize=3,
      linestyle=style,
      label=r['weights'],
    )
    y = plots.smooth(curves[(r['run'], last)])
    b.plot(y, linestyle=style, label=r['weights'])
  a.set_xscale('log')
  a.set(xlabel='peak learning rate', ylabel='digits validation accuracy, %')
  b.set_yscale('log')
  b.set(xlabel='step', ylabel='train loss (smoothed)', title=last)
  for ax in (a, b):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle('No master copy: nearest rounding stalls, stochastic tracks')
  return plots.save(fig, path)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the sweep `cfg`; writes the outputs to `out`; returns rows."""
  exp = aqtr_fiddle.build(cfg)
  rows, curves = sweep.run(exp, progress=print if echo else None)
  cols = ['run', 'weights', 'params KB']
  formats = {'params KB': '.1f'}
  for lr in exp.learning_rates:
    cols += [exp.column(lr), f'sd {lr:g}']
    formats |= {exp.column(lr): '.2f', f'sd {lr:g}': '.2f'}
  claim.finish(out, cfg, report.table(rows, cols, formats), echo=echo)
  plot(exp, rows, curves, pathlib.Path(out) / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
