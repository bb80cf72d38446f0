"""DeepSeek's FP8 recipes against float on the stock MoE decoder.

Each seed is one `aqtr.train.job.run` of the experiment with the MoE runs
of `aqtr.train.stock_moe` (float, per-tensor current fp8, delayed
scaling, MaxText's recipe, the DeepSeek-V3 paper's blockwise recipe),
called by name as `aqtr-train` does. The metric is the final validation
loss; its gap to float is taken per seed (within a seed every run starts
from the same weights and sees the same batches) and averaged; `gap sd`
is its spread over the seeds.

`check` reads the table against the targets: each recipe within 1 % of
float's validation loss, and whether that gap is outside the seed spread.

Example:
  >>> rows = [{'run': 'moe_float', 'gap': 0.0, 'gap sd': 0.0},
  ...         {'run': 'moe_deepseek_v3_fp8', 'gap': 0.004, 'gap sd': 0.002}]
  >>> check(rows)[0]
  ('moe_deepseek_v3_fp8 within 1 % of float', True, '+0.40 % (seed sd 0.20 %)')
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
from typing import Any

import fiddle as fdl
import numpy as np

from aqtr.train import job, stock_moe

__all__ = ['REF', 'RUNS', 'TARGET', 'Fp8Recipes', 'check', 'collect', 'rows']

REF = 'moe_float'
RUNS = stock_moe.NAMES
TARGET = 0.01  # Validation loss within 1 % of float.
WHAT = {
  'moe_float': 'float32 (no rules)',
  'moe_fp8': 'e4m3 fwd / e5m2 grads, current per-channel scales',
  'moe_fp8_delayed': 'e4m3 / e5m2, per-tensor delayed scaling (16 steps)',
  'moe_maxtext_fp8': 'MaxText: static (calibrated) activations, e5m2 grads',
  'moe_deepseek_v3_fp8': 'paper: e4m3 everywhere, 1x128 / 128x128 online',
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Recipes:
  """The comparison: one aqtr-train experiment, run once per seed.

  Attributes:
    experiment: `fdl.Config(aqtr.train.experiment.Experiment)` whose runs
      start with 'moe_float' (kept unbuilt: `run` sets its seed).
    seeds: `Experiment.seed` of each repetition (paired across runs).
  """

  experiment: Any = None
  seeds: tuple[int, ...] = (0, 1, 2)

  def __post_init__(self):
    if not self.seeds or not all(
      isinstance(s, int) and s >= 0 for s in self.seeds
    ):
      raise ValueError(
        f'Fp8Recipes.seeds must be ints >= 0, at least one, got {self.seeds}.'
      )


def run(cfg: fdl.Config, out: pathlib.Path, progress=print) -> list[dict]:
  """One row per run; the job outputs of seed n go to `out/seed<n>`.

  Args:
    cfg: `fdl.Config(Fp8Recipes)`.
    out: the output folder.
    progress: called with a line per finished seed (None: quiet, no bars).
  """
  exp_cfg = cfg.experiment
  if not isinstance(exp_cfg, fdl.Config):
    raise ValueError(
      'Fp8Recipes.experiment must be an fdl.Config of '
      f'aqtr.train.experiment.Experiment, got {exp_cfg!r:.100}.'
    )
  names = tuple(exp_cfg.runs)
  if not names or names[0] != REF:
    raise ValueError(f"the experiment's runs must start with {REF!r}: {names}")
  seeds = fdl.build(fdl.copy_with(cfg, experiment=None)).seeds
  per_seed = []
  for i, seed in enumerate(seeds):
    c = copy.deepcopy(exp_cfg)
    c.seed = seed
    if progress is not None:
      progress(f'seed {seed} ({i + 1}/{len(seeds)}): runs {", ".join(names)}')
    got = job.run(
      c,
      out / f'seed{seed}',
      show_progress=progress is not None,
      echo=False,
      overwrite=True,
    )
    per_seed.append({r['run']: r for r in got})
    if progress is not None:
      progress(
        f'seed {seed}: val loss '
        + ', '.join(f'{n} {r["val loss"]:.4f}' for n, r in per_seed[-1].items())
      )
  return rows(per_seed, names)


def collect(out: pathlib.Path, seeds) -> list[dict[str, dict]]:
  """The per-seed summaries `run` left (`out/seed<n>/summary.json`)."""
  per_seed = []
  for seed in seeds:
    got = json.loads((out / f'seed{seed}' / 'summary.json').read_text())
    per_seed.append({r['run']: r for r in got})
  return per_seed


def rows(per_seed: list[dict[str, dict]], names) -> list[dict[str, Any]]:
  """The table's rows from each seed's job summary rows (by run name)."""
  out = []
  ref = np.array([float(s[REF]['val loss']) for s in per_seed])
  for name in names:
    loss = np.array([float(s[name]['val loss']) for s in per_seed])
    gap = loss / ref - 1
    out.append(
      {
        'run': name,
        'recipe': WHAT.get(name, '-'),
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


def check(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
  """(statement, verdict, numbers) per quantized run: gap <= `TARGET`."""
  out = []
  for r in rows:
    if r['run'] == REF:
      continue
    out.append(
      (
        f'{r["run"]} within {100 * TARGET:.0f} % of float',
        r['gap'] <= TARGET,
        f'{100 * r["gap"]:+.2f} % (seed sd {100 * r["gap sd"]:.2f} %)',
      )
    )
  return out
