"""Trains float / int8 / int4 / forward-int2 MLPs; writes table and plot.

  python -m papers.int8_training_matches_float.run  # 40 s CPU, 2 min loaded
  python -m papers.int8_training_matches_float.run --config=config:small \
    --out_dir=/tmp/int8

Writes results.md (the table), results.png (train loss curves),
config.txt to --out_dir (default: this folder).
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl

from papers.int8_training_matches_float import config
from papers.lib import claim, cli

__all__ = ['main', 'run']

TITLE = 'int8 fwd+bwd trains like float; int4 is worse; fwd int2 fails'


def run(cfg: fdl.Config, out: pathlib.Path, echo: bool = True) -> list[Any]:
  """Runs the comparison `cfg`; writes the outputs to `out`; returns rows."""
  return claim.comparison(cfg, out, TITLE, echo)


def main(argv=None) -> None:
  """Command-line entry point (`--config` flags as in aqtr-train)."""
  cli.main(config, run, argv)


if __name__ == '__main__':
  main()
