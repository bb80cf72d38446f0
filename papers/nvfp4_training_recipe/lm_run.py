"""Trains the LM ablation (`aqtr-train` runs); writes table, plot, config.

  python -m papers.nvfp4_training_recipe.lm_run   # ~45 min, 2 busy cores
  python -m papers.nvfp4_training_recipe.lm_run --config=config:small \
    --out_dir=/tmp/nvfp4_lm

Writes results.md (the table and the claim's checks), results.png (gap to
float per run, one dot per seed), config.txt and each seed's aqtr-train
outputs (seed<n>/) to --out_dir (default: this folder's lm/).
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import fiddle as fdl

from aqtr.train import experiment, report
from papers.lib import claim, cli, plots
from papers.nvfp4_training_recipe import lm_ablation, lm_config

__all__ = ['COLUMNS', 'checks_table', 'main', 'run', 'tabulate', 'write']

COLUMNS = (
  'run',
  'float layers',
  'val loss',
  'sd',
  'gap',
  'gap sd',
  'gap per seed',
  'serve==train',
)
FORMATS = {'val loss': '.4f', 'sd': '.4f', 'gap': '+.4f', 'gap sd': '.4f'}


def checks_table(rows: list[dict[str, Any]]) -> str:
  """The claim's checks (`lm_ablation.check`) as a Markdown table."""
  checks = [
    {'statement': s, 'verdict': v, 'numbers': n}
    for s, v, n in lm_ablation.check(rows)
  ]
  return report.table(checks, ('statement', 'verdict', 'numbers'))


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the LM ablation `cfg`; writes the outputs to `out`; returns rows."""
  out = pathlib.Path(out)
  rows = lm_ablation.run(cfg, out, progress=print if echo else None)
  return write(cfg, out, rows, echo)


def tabulate(cfg: fdl.Config, out: pathlib.Path, seeds=None) -> list[Any]:
  """`run`'s outputs from the seeds already trained in `out/seed<n>`."""
  out = pathlib.Path(out)
  seeds = cfg.seeds if seeds is None else seeds
  exp = experiment.split(cfg.experiment)[0]
  rows = lm_ablation.rows(lm_ablation.collect(out, seeds), exp)
  return write(cfg, out, rows, echo=True)


def write(cfg, out: pathlib.Path, rows: list, echo: bool = True) -> list:
  """Writes results.md (table and checks), results.png and config.txt."""
  claim.finish(
    out,
    cfg,
    report.table(rows, COLUMNS, FORMATS),
    checks_table(rows),
    echo=echo,
  )
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7, 3.5))
  names = [r['run'] for r in rows]
  ax.barh(names, [100 * r['gap'] for r in rows], color='0.75')
  for i, r in enumerate(rows):
    seeds = [float(g) for g in r['gap per seed'].split()]
    ax.plot(seeds, [i] * len(seeds), 'k.', ms=5)
  ax.invert_yaxis()
  ax.axvline(0, color='k', lw=0.8)
  ax.set_xlabel('validation loss above float (%); dots: seeds')
  ax.set_title('NVFP4 recipe ablation, byte LM (aqtr-train)')
  plots.save(fig, out / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  argv = sys.argv if argv is None else argv
  cfg, out = cli.parse(lm_config, argv)
  out = pathlib.Path(out) if out else pathlib.Path(__file__).parent / 'lm'
  run(cfg, out)
  print(f'outputs: {out}/results.md, {out}/results.png')


if __name__ == '__main__':
  main()
