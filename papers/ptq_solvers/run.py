"""Trains the float LM, runs every PTQ method; writes table, plot, config.

  python -m papers.ptq_solvers.run      # ~15 min on 2 loaded cores
  python -m papers.ptq_solvers.run --config=config:small --out_dir=/tmp/p
  python -m papers.ptq_solvers.run --config="set:grids=('w4',)"

Writes results.md (the tables), results.png (bpc per grid and method)
and config.txt to --out_dir (default: this folder).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.lib import claim, cli, plots
from papers.ptq_solvers import config, study

__all__ = ['main', 'run']

FORMATS = {
  'bpc': '.4f',
  'gap': '+.4f',
  'closed': '.2f',
  'layer error': '.2e',
  's': '.1f',
  'gap %': '+.2f',
}


def _weights_table(rows, base: float) -> str:
  out = []
  for r in rows:
    rtn = next(
      x['gap'] for x in rows if x['grid'] == r['grid'] and x['method'] == 'rtn'
    )
    closed = 1 - r['gap'] / rtn if rtn > 0 else float('nan')
    out.append(
      {
        'grid': r['grid'],
        'method': r['method'],
        'bpc': r['bpc'],
        'gap': r['gap'],
        'closed': closed,
        'layer error': r['error'],
        's': r['seconds'],
      }
    )
  cols = ('grid', 'method', 'bpc', 'gap', 'closed', 'layer error', 's')
  head = (
    f'float bpc {base:.4f}; gap = bpc - float; closed = 1 - gap / RTN gap\n\n'
  )
  return head + report.table(out, cols, FORMATS)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> dict:
  """Runs the study `cfg`; writes the outputs to `out`; returns its rows."""
  lm = cfg.lm
  s = aqtr_fiddle.build(fdl.copy_with(cfg, lm=None))
  s = dataclasses.replace(s, lm=lm)
  res = study.run(s, progress=print if echo else None)
  base = res['float'][0]['bpc']
  curve = ', '.join(f'{h["step"]}: {h["bpc"]:.4f}' for h in res['curve'])
  parts = [
    f'Float LM validation bpc by step: {curve}',
    '### Weight-only grids\n\n' + _weights_table(res['weights'], base),
  ]
  if res['formats']:
    parts.append(
      '### Other 4-bit formats (GPTQ vs RTN)\n\n'
      + _weights_table(res['formats'], base)
    )
  parts.append(
    '### SmoothQuant: W8A8 on the LM with injected activation outliers\n\n'
    + report.table(res['smoothquant'], ('run', 'bpc', 'gap %'), FORMATS)
  )
  text = '\n\n'.join(parts)
  claim.finish(out, cfg, text, echo=echo)
  _plot(res, pathlib.Path(out) / 'results.png', base)
  return res


def _plot(res: dict[str, Any], path: pathlib.Path, base: float) -> None:
  plt = plots.pyplot()
  rows = res['weights'] + res['formats']
  grids = list(dict.fromkeys(r['grid'] for r in rows))
  methods = list(dict.fromkeys(r['method'] for r in rows))
  fig, ax = plt.subplots(figsize=(8, 4))
  width = 0.8 / len(methods)
  for j, m in enumerate(methods):
    xs, ys = [], []
    for i, g in enumerate(grids):
      r = [x for x in rows if x['grid'] == g and x['method'] == m]
      if r:
        xs.append(i + j * width)
        ys.append(r[0]['bpc'] - base)
    ax.bar(xs, ys, width, label=m)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(grids))], grids)
  ax.set_ylabel('validation bpc above float')
  ax.set_title(f'PTQ of the byte LM (float bpc {base:.3f})')
  ax.legend()
  plots.save(fig, path)


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
