"""The clip oracle on N(0, 1) and W2 / A2 PTQ of digits per calibration.

  python -m papers.calibration_shootout.run
  python -m papers.calibration_shootout.run --config=config:small \
    --out_dir=/tmp/cal

Writes results.md (two tables: the oracle; PTQ accuracy), results.png
(MSE against clip per bit width; accuracy per calibration) and config.txt
to --out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl
import numpy as np

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.calibration_shootout import config, shootout
from papers.lib import claim, cli, plots

__all__ = ['main', 'oracle_rows', 'plot', 'run']


def oracle_rows(exp: shootout.Shootout) -> list[dict[str, Any]]:
  """Per bit width: the oracle's clip and the `mse` calibration's pick."""
  return [
    {
      'bits': b,
      'oracle clip / sigma': shootout.oracle(b, exp.clips),
      'mse calibration / sigma': shootout.sample_choice(b, exp.samples),
    }
    for b in exp.oracle_bits
  ]


def plot(exp, oracle, ptq, path: pathlib.Path) -> pathlib.Path:
  """MSE(clip) per bit width with the optimum; PTQ accuracy bars."""
  plt = plots.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
  lo, hi, _ = exp.clips
  grid = np.linspace(lo, hi, 181)
  for r in oracle:
    c, m = shootout.oracle_curve(r['bits'], grid, n=40_001)
    line = a.plot(c, m / m.min(), label=f'{r["bits"]} bits')[0]
    a.axvline(r['oracle clip / sigma'], color=line.get_color(), ls=':')
  a.set_yscale('log')
  a.set(
    xlabel='clip / sigma',
    ylabel='MSE / min MSE',
    title='N(0, 1): the MSE-optimal clip grows with bits',
  )
  a.legend()
  names = [r['calibration'] for r in ptq]
  x = np.arange(len(names))
  bits = exp.bits
  w = [r[f'W{bits}'] if r[f'W{bits}'] is not None else 0 for r in ptq]
  b.bar(x - 0.2, w, 0.4, label=f'W{bits} (weights)')
  b.bar(x + 0.2, [r[f'A{bits}'] for r in ptq], 0.4, label=f'A{bits} (inputs)')
  b.set_xticks(x, names, rotation=30, ha='right')
  b.set(ylabel='digits validation accuracy, %', title='PTQ per calibration')
  b.legend()
  for ax in (a, b):
    ax.grid(alpha=0.3)
  return plots.save(fig, path)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True):
  """Runs the shootout `cfg`; writes the outputs; returns (oracle, ptq)."""
  exp = aqtr_fiddle.build(cfg)
  oracle = oracle_rows(exp)
  ptq = shootout.ptq(exp, progress=print if echo else None)
  b = exp.bits
  first = report.table(
    oracle,
    ['bits', 'oracle clip / sigma', 'mse calibration / sigma'],
    {'oracle clip / sigma': '.3f', 'mse calibration / sigma': '.3f'},
  )
  fmt = {f'W{b}': '.2f', 'W sd': '.2f', f'A{b}': '.2f', 'A sd': '.2f'}
  cols = ['calibration', f'W{b}', 'W sd', f'A{b}', 'A sd']
  second = report.table(ptq, cols, fmt)
  claim.finish(out, cfg, first, second, echo=echo)
  plot(exp, oracle, ptq, pathlib.Path(out) / 'results.png')
  return oracle, ptq


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
