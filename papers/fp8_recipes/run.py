"""Trains the FP8 recipes on the stock MoE (`aqtr-train` runs by name).

  python -m papers.fp8_recipes.run        # ~10 min on 2 shared cores
  python -m papers.fp8_recipes.run --config=config:small --out_dir=/tmp/f

Writes results.md (the gap table and the 1 % target's checks),
results.png (gap to float per run, one dot per seed), config.txt and
each seed's aqtr-train outputs (seed<n>/) to --out_dir (default: this
folder). Progress: one line per seed and aqtr-train's bars.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import fiddle as fdl

from aqtr.train import report
from papers.fp8_recipes import config, recipes
from papers.lib import claim, cli, plots

__all__ = ['COLUMNS', 'main', 'run', 'tabulate', 'write']

COLUMNS = (
  'run',
  'recipe',
  'val loss',
  'sd',
  'gap',
  'gap sd',
  'gap per seed',
  'serve==train',
)
FORMATS = {'val loss': '.4f', 'sd': '.4f', 'gap': '+.4f', 'gap sd': '.4f'}


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs `cfg` (`fdl.Config(Fp8Recipes)`); writes to `out`; returns rows."""
  out = pathlib.Path(out)
  rows = recipes.run(cfg, out, progress=print if echo else None)
  return write(cfg, out, rows, echo)


def tabulate(cfg: fdl.Config, out: pathlib.Path) -> list[Any]:
  """`run`'s outputs from the seeds already trained in `out/seed<n>`."""
  out = pathlib.Path(out)
  per_seed = recipes.collect(out, cfg.seeds)
  return write(cfg, out, recipes.rows(per_seed, cfg.experiment.runs))


def write(cfg, out: pathlib.Path, rows: list, echo: bool = True) -> list:
  """Writes results.md (table and checks), results.png and config.txt."""
  checks = [
    {'statement': s, 'verdict': v, 'numbers': n}
    for s, v, n in recipes.check(rows)
  ]
  claim.finish(
    out,
    cfg,
    report.table(rows, COLUMNS, FORMATS),
    report.table(checks, ('statement', 'verdict', 'numbers')),
    echo=echo,
  )
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(7, 3.2))
  names = [r['run'] for r in rows]
  ax.barh(names, [100 * r['gap'] for r in rows], color='0.75')
  for i, r in enumerate(rows):
    seeds = [float(g) for g in r['gap per seed'].split()]
    ax.plot(seeds, [i] * len(seeds), 'k.', ms=5)
  ax.invert_yaxis()
  ax.axvline(0, color='k', lw=0.8)
  for x in (-100 * recipes.TARGET, 100 * recipes.TARGET):
    ax.axvline(x, color='r', lw=0.8, ls='--')
  ax.set_xlabel('validation loss vs float (%); dots: seeds; red: 1 % target')
  ax.set_title('DeepSeek FP8 recipes on a stock MoE decoder (aqtr-train)')
  fig.tight_layout()
  plots.save(fig, out / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  argv = sys.argv if argv is None else argv
  cfg, out = cli.parse(config, argv)
  out = pathlib.Path(out) if out else pathlib.Path(__file__).parent
  run(cfg, out)
  print(f'outputs: {out}/results.md, {out}/results.png')


if __name__ == '__main__':
  main()
