"""The NVFP4 recipe ablation on the main job's LM (`aqtr-train` runs).

Each seed is one `aqtr.train.job.run` of the experiment with every run of
`RUNS` (float, fp8, naive NVFP4, the recipe, the recipe less one
ingredient); the recipe runs keep their high-precision layers float
(`aqtr.train.experiment.RECIPE_KEEP`: the last block and the logits
head). The metric is the final validation loss; its gap to float is taken
per seed (same initial weights and batches within a seed) and averaged.

`check` reads the table against the claim: the recipe beats naive NVFP4,
it is the NVFP4 run closest to fp8, and each removed ingredient hurts by
more than the seed spread, helps, or is within it ('does not matter at
this scale'); the full recipe's gap is compared with 2x fp8's.

Example:
  >>> rows = [
  ...   {'run': 'float', 'gap': 0.0, 'gap sd': 0.0},
  ...   {'run': 'fp8', 'gap': 0.001, 'gap sd': 0.002},
  ...   {'run': 'nvfp4_naive', 'gap': 0.05, 'gap sd': 0.002},
  ...   {'run': 'nvfp4_recipe', 'gap': 0.02, 'gap sd': 0.002}]
  >>> check(rows)[0]
  ('recipe beats naive NVFP4', True, 'gap +2.00 % vs +5.00 %')
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
from typing import Any

import fiddle as fdl
import numpy as np

from aqtr.train import experiment, job

__all__ = ['ABLATIONS', 'RUNS', 'LmAblation', 'check', 'collect', 'rows', 'run']

# What each ablation run removes from the recipe.
ABLATIONS = {
  'nvfp4_recipe_no_rht': 'RHT-16 on the wgrad inputs',
  'nvfp4_recipe_no_sr': 'stochastic rounding of the gradients',
  'nvfp4_recipe_no_2d': '16x16 weight blocks (1x16 instead)',
  'nvfp4_training': 'the high-precision layers',
}
RUNS = ('float', 'fp8', 'nvfp4_naive', 'nvfp4_recipe', *ABLATIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmAblation:
  """The LM ablation: one aqtr-train experiment, run once per seed.

  Attributes:
    experiment: `fdl.Config(aqtr.train.experiment.Experiment)`, kept
      unbuilt (`run` takes it apart); 'float' first among its runs.
    seeds: `Experiment.seed` of each repetition.
  """

  experiment: Any = None
  seeds: tuple[int, ...] = (0, 1)

  def __post_init__(self):
    if not self.seeds or not all(
      isinstance(s, int) and s >= 0 for s in self.seeds
    ):
      raise ValueError(
        f'LmAblation.seeds must be ints >= 0, at least one, got {self.seeds}.'
      )


def _seed_rows(exp_cfg: fdl.Config, seed: int, out: pathlib.Path, echo):
  cfg = copy.deepcopy(exp_cfg)
  cfg.seed = seed
  rows = job.run(cfg, out, show_progress=False, echo=echo, overwrite=True)
  return {r['run']: r for r in rows}


def run(
  cfg: fdl.Config, out: pathlib.Path, progress=None
) -> list[dict[str, Any]]:
  """One row per run: val loss (mean, sd over seeds), gap to float.

  Args:
    cfg: `fdl.Config(LmAblation)`.
    out: the job outputs go to `out/seed<n>`.
    progress: called with a line per finished seed, or None.
  """
  exp_cfg = cfg.experiment
  if not isinstance(exp_cfg, fdl.Config):
    raise ValueError(
      'LmAblation.experiment must be an fdl.Config of '
      f'aqtr.train.experiment.Experiment, got {exp_cfg!r:.100}.'
    )
  abl = fdl.build(fdl.copy_with(cfg, experiment=None))
  names = tuple(exp_cfg.runs)
  if not names or names[0] != 'float':
    raise ValueError(f"the experiment's runs must start with 'float': {names}")
  per_seed = []
  for seed in abl.seeds:
    per_seed.append(_seed_rows(exp_cfg, seed, out / f'seed{seed}', False))
    if progress is not None:
      losses = {n: r['val loss'] for n, r in per_seed[-1].items()}
      progress(
        f'seed {seed}: ' + ', '.join(f'{n} {v}' for n, v in losses.items())
      )
  return rows(per_seed, experiment.split(exp_cfg)[0])


def collect(out: pathlib.Path, seeds) -> list[dict[str, dict]]:
  """The per-seed summaries `run` left in `out/seed<n>/summary.json` (to
  tabulate finished seeds again, e.g. after an interrupted run)."""
  per_seed = []
  for seed in seeds:
    rows = json.loads((out / f'seed{seed}' / 'summary.json').read_text())
    per_seed.append({r['run']: r for r in rows})
  return per_seed


def rows(per_seed: list[dict[str, dict]], exp) -> list[dict[str, Any]]:
  """The table's rows from each seed's job summary rows (by run name).

  Args:
    per_seed: one {run: summary row} per seed, 'float' among the runs.
    exp: the Experiment (its runs' order, their float layers).
  """
  out = []
  for name in exp.runs:
    loss = np.array([float(s[name]['val loss']) for s in per_seed])
    ref = np.array([float(s['float']['val loss']) for s in per_seed])
    gap = loss / ref - 1
    keep = experiment.kept_float(name, exp)
    out.append(
      {
        'run': name,
        'float layers': keep.label() if keep else '-',
        'val loss': float(loss.mean()),
        'sd': float(loss.std()),
        'gap': float(gap.mean()),
        'gap sd': float(gap.std()),
        'gap per seed': ' '.join(f'{100 * g:+.2f}' for g in gap),
        'serve==train': all(
          s[name]['serve==train'] in (True, '-') for s in per_seed
        ),
      }
    )
  return out


def _pct(g: float) -> str:
  return f'{100 * g:+.2f} %'


def _sd(g: float) -> str:
  return f'{100 * g:.2f} %'


def check(rows: list[dict[str, Any]]) -> list[tuple[str, bool | str, str]]:
  """The claim's statements read off `rows`: (statement, verdict, numbers).

  A removal's verdict is 'hurts' / 'helps' when its gap differs from the
  recipe's by more than the larger seed spread (gap sd) of the two, else
  'within noise'. Statements whose runs are missing are left out.
  """
  by = {r['run']: r for r in rows}
  out = []
  if {'nvfp4_recipe', 'nvfp4_naive'} <= set(by):
    r, n = by['nvfp4_recipe']['gap'], by['nvfp4_naive']['gap']
    out.append(
      ('recipe beats naive NVFP4', r < n, f'gap {_pct(r)} vs {_pct(n)}')
    )
  nv = [k for k in by if k.startswith('nvfp4')]
  if 'fp8' in by and 'nvfp4_recipe' in nv:
    f = by['fp8']['gap']
    closest = min(nv, key=lambda k: abs(by[k]['gap'] - f))
    out.append(
      (
        'recipe is the NVFP4 run closest to fp8',
        closest == 'nvfp4_recipe',
        f'closest: {closest} ({_pct(by[closest]["gap"])}; fp8 {_pct(f)})',
      )
    )
    r, f_sd = by['nvfp4_recipe'], by['fp8']['gap sd']
    out.append(
      (
        "recipe's gap <= 2x fp8's",
        r['gap'] <= 2 * f,
        f'{_pct(r["gap"])} (seed sd {_sd(r["gap sd"])}) vs 2 x {_pct(f)} '
        f'(seed sd {_sd(f_sd)}: fp8 '
        + ('within' if abs(f) <= f_sd else 'outside')
        + ' its noise of 0)',
      )
    )
  if 'nvfp4_recipe' in by:
    r = by['nvfp4_recipe']
    for name, what in ABLATIONS.items():
      if name not in by:
        continue
      a = by[name]
      d = a['gap'] - r['gap']
      noise = max(a['gap sd'], r['gap sd'])
      verdict = (
        'hurts' if d > noise else 'helps' if d < -noise else 'within noise'
      )
      out.append(
        (f'removing {what}', verdict, f'{_pct(d)} (seed sd {_sd(noise)})')
      )
  return out
