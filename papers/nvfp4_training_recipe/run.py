"""Trains the ablation's MLPs; writes the table, the plot and the config.

  python -m papers.nvfp4_training_recipe.run   # ~6 min on 2 shared cores
  python -m papers.nvfp4_training_recipe.run --config=config:small \
    --out_dir=/tmp/nvfp4

Writes results.md (the table), results.png (gap to float per run) and
config.txt to --out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.lib import claim, cli, plots
from papers.nvfp4_training_recipe import ablation, config

__all__ = ['main', 'run']

COLUMNS = ('run', 'float layers', 'val MSE', 'sd', 'gap to float')
FORMATS = {'val MSE': '.4e', 'sd': '.1e', 'gap to float': '+.3f'}


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the ablation `cfg`; writes the outputs to `out`; returns rows."""
  exp = aqtr_fiddle.build(cfg)
  rows = ablation.run(exp, progress=print if echo else None)
  claim.finish(out, cfg, report.table(rows, COLUMNS, FORMATS), echo=echo)
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.barh([r['run'] for r in rows], [100 * r['gap to float'] for r in rows])
  ax.invert_yaxis()
  ax.set_xlabel('validation MSE above float (%)')
  ax.set_title('NVFP4 training: recipe and ablations (teacher MLP)')
  plots.save(fig, pathlib.Path(out) / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
