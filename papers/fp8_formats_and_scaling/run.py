"""Trains float and fp8 MLPs (gradient formats, scaling); table and plot.

  python -m papers.fp8_formats_and_scaling.run  # 1 min CPU, 2.5 min loaded
  python -m papers.fp8_formats_and_scaling.run --config=config:small \
    --out_dir=/tmp/fp8

Writes results.md (the table), results.png (train loss curves),
config.txt to --out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl

from papers.fp8_formats_and_scaling import config
from papers.lib import claim, cli

__all__ = ['main', 'run']

TITLE = (
  'fp8: e4m3 fwd + e5m2 grads train like float; unscaled e4m3 grads do not'
)


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the comparison `cfg`; writes the outputs to `out`; returns rows."""
  return claim.comparison(cfg, out, TITLE, echo)


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
