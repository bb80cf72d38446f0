"""SQNR and served loss of MX / NVFP4 / NF4 vs per-channel int formats.

  python -m papers.microscaling_formats.run
  python -m papers.microscaling_formats.run --config=config:small \
    --out_dir=/tmp/mx

Writes results.md (one row per format), results.png (SQNR per format and
source; served loss per format) and config.txt to --out_dir (default:
this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl
import numpy as np

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.lib import claim, cli, plots
from papers.microscaling_formats import config, formats

__all__ = ['main', 'plot', 'run']


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> pathlib.Path:
  """SQNR (dB) per format and source; served loss per format."""
  plt = plots.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4))
  fs = rows[1:]  # without float
  sources = [k for k in fs[0] if k.endswith(' dB')]
  x = np.arange(len(fs))
  width = 0.8 / len(sources)
  for i, src in enumerate(sources):
    a.bar(
      x + (i - (len(sources) - 1) / 2) * width,
      [r[src] for r in fs],
      width,
      label=src.removesuffix(' dB'),
    )
  names = [f'{r["format"]}\n{r["bits/value"]:.2f} b' for r in fs]
  a.set_xticks(x, names, fontsize=8)
  a.set(ylabel='SQNR, dB', title='Quantization SQNR (bits per value below)')
  x = np.arange(len(rows))
  b.bar(x, [r['loss / float'] for r in rows])
  b.axhline(1.0, color='k', lw=0.8)
  b.set_xticks(x, [r['format'] for r in rows], rotation=30, ha='right')
  b.set(ylabel='served validation loss / float', title='Served MLP')
  for ax in (a, b):
    ax.grid(alpha=0.3)
  a.legend()
  return plots.save(fig, path)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the comparison `cfg`; writes the outputs to `out`; returns rows."""
  exp = aqtr_fiddle.build(cfg)
  rows = formats.run(exp, progress=print if echo else None)
  cols = ['format', 'bits/value']
  cols += [f'{d} dB' for d in exp.distributions]
  cols += ['MLP weights dB', 'served loss', 'loss / float']
  fmt = {c: '.2f' for c in cols[2:-2]}
  fmt |= {'bits/value': '.3f', 'served loss': '.4e', 'loss / float': '.3f'}
  claim.finish(out, cfg, report.table(rows, cols, fmt), echo=echo)
  plot(rows, pathlib.Path(out) / 'results.png')
  return rows


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
