"""Trains the equal-bytes width sweep; writes the table and the Pareto plot.

  python -m papers.four_bit_pareto.run        # ~1 min CPU, 3.5 min loaded
  python -m papers.four_bit_pareto.run --config=config:small --out_dir=/tmp/p

Writes results.md, results.png (accuracy vs weight KB, one line per
precision) and config.txt to --out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.four_bit_pareto import config, sweep
from papers.lib import claim, cli, plots

__all__ = ['main', 'plot', 'run']

COLUMNS = ['run', 'bits', 'width', 'weight KB', 'accuracy', 'sd']
FORMATS = {'weight KB': '.3f', 'accuracy': '.2f', 'sd': '.2f'}


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> pathlib.Path:
  """Accuracy against weight KB (log), one line per run."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  for name in dict.fromkeys(r['run'] for r in rows):
    rs = [r for r in rows if r['run'] == name]
    ax.errorbar(
      [r['weight KB'] for r in rs],
      [r['accuracy'] for r in rs],
      yerr=[r['sd'] for r in rs],
      marker='o',
      capsize=3,
      label=f'{name} ({rs[0]["bits"]} bits/weight)',
    )
  ax.set_xscale('log', base=2)
  ax.set(
    xlabel='weight KB',
    ylabel='digits validation accuracy, %',
    title='Equal bytes: wider 4-bit beats 8-bit and bf16',
  )
  ax.grid(alpha=0.3)
  ax.legend()
  return plots.save(fig, path)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the sweep `cfg`; writes the outputs to `out`; returns rows."""
  exp = aqtr_fiddle.build(cfg)
  rows = sweep.run(exp, progress=print if echo else None)
  claim.finish(out, cfg, report.table(rows, COLUMNS, FORMATS), echo=echo)
  plot(rows, pathlib.Path(out) / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
