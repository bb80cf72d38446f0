"""A benchmark under two source trees in one run: a git revision and now.

Extracts `aqtr/` at `--rev` into a temporary folder and runs the
benchmark script (which must take `--json` and print one JSON row per
line with 'ms') alternately with PYTHONPATH at that copy (before) and at
this working tree (after), `--alternations` times; per row (its keys
other than the timings) the minimum ms of each side, and after/before.

Run: python benchmarks/before_after.py --rev main -- \\
  benchmarks/ragged_dot.py --rounds 3 --shapes 512x256x512x8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
_TIMES = {'ms', 'ratio', 'compile_ratio'}


def _cpu() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  except OSError:
    return platform.processor() or 'unknown CPU'
  for line in out.splitlines():
    if line.startswith('Model name'):
      return line.split(':', 1)[1].strip()
  return 'unknown CPU'


def _rows(src: pathlib.Path, argv: list[str]) -> list[dict]:
  env = dict(os.environ, PYTHONPATH=str(src))
  out = subprocess.run(
    [sys.executable, *argv, '--json'],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return [json.loads(line) for line in out.splitlines() if line[:1] == '{']


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rev', default='main', help='the "before" revision')
  p.add_argument('--alternations', type=int, default=2)
  p.add_argument('script', nargs=argparse.REMAINDER)
  a = p.parse_args(argv)
  script = [s for s in a.script if s != '--']
  best: dict[tuple, dict[str, float]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    archive = subprocess.run(
      ['git', 'archive', a.rev, 'aqtr'],
      cwd=ROOT,
      capture_output=True,
      check=True,
    ).stdout
    subprocess.run(['tar', '-x', '-C', tmp], input=archive, check=True)
    for _ in range(a.alternations):
      for side, src in (('before', pathlib.Path(tmp)), ('after', ROOT)):
        for r in _rows(src, script):
          key = tuple((k, v) for k, v in r.items() if k not in _TIMES)
          got = best.setdefault(key, {})
          got[side] = min(got.get(side, float('inf')), r['ms'])
  now = datetime.datetime.now(datetime.UTC)
  print(
    f'`python benchmarks/before_after.py --rev {a.rev} -- '
    f'{" ".join(script)}`; {_cpu()}, {os.cpu_count()} CPUs, '
    f'{now:%Y-%m-%d %H:%M} UTC, load average '
    f'{os.getloadavg()[0]:.1f}; min ms over {a.alternations} alternations'
  )
  if not best:
    return
  names = [k for k, _ in next(iter(best))]
  print('| ' + ' | '.join(names) + ' | before ms | after ms | after/before |')
  print('|' + '---|' * (len(names) + 3))
  for key, t in best.items():
    b, f = t.get('before', float('nan')), t.get('after', float('nan'))
    cells = [str(v) for _, v in key]
    print(f'| {" | ".join(cells)} | {b:.2f} | {f:.2f} | {f / b:.2f} |')


if __name__ == '__main__':
  main()
