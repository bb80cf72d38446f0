"""A benchmark under two source trees in one run: a git revision and now.

Extracts `aqtr/` at `--rev` into a temporary folder and runs the
benchmark script (which must take `--json` and print one JSON row per
line) alternately with PYTHONPATH at that copy (before) and at this
working tree (after), `--alternations` times (an inherited PYTHONPATH is
kept after the tree). A row is identified by its
text fields; each numeric field gets the minimum of each side (`ratio`
fields, relative to another row, are dropped) and after/before.

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
_DROPPED = {'ratio', 'compile_ratio'}


def unpack(rev: str, into: str) -> None:
  """The package `aqtr` as it is at git revision `rev`, unpacked `into`."""
  archive = subprocess.run(
    ['git', 'archive', rev, 'aqtr'], cwd=ROOT, capture_output=True, check=True
  ).stdout
  subprocess.run(['tar', '-x', '-C', into], input=archive, check=True)


def _cpu() -> str:
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True).stdout
  except OSError:
    return platform.processor() or 'unknown CPU'
  for line in out.splitlines():
    if line.startswith('Model name'):
      return line.split(':', 1)[1].strip()
  return 'unknown CPU'


def rows(src: pathlib.Path, argv: list[str]) -> list[dict]:
  """The JSON rows `argv` (a script and its flags, `--json` added) prints
  with PYTHONPATH at the tree `src`."""
  # The tree first; an inherited PYTHONPATH (e.g. a peer library installed
  # with `pip install --target`) stays reachable after it.
  path = [str(src), *filter(None, [os.environ.get('PYTHONPATH')])]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
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
    unpack(a.rev, tmp)
    for _ in range(a.alternations):
      for side, src in (('before', pathlib.Path(tmp)), ('after', ROOT)):
        for r in rows(src, script):
          key = tuple((k, v) for k, v in r.items() if isinstance(v, str))
          got = best.setdefault(key, {})
          for k, v in r.items():
            if k not in _DROPPED and not isinstance(v, str):
              old = got.get((k, side), float('inf'))
              got[(k, side)] = min(old, v)
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
  fields = list(dict.fromkeys(k for t in best.values() for k, _ in t))
  head = [f'{f} {s}' for f in fields for s in ('before', 'after', 'a/b')]
  print('| ' + ' | '.join(names + head) + ' |')
  print('|' + '---|' * len(names) + '---:|' * len(head))
  nan = float('nan')
  for key, t in best.items():
    cells = [str(v) for _, v in key]
    for f in fields:
      b, a = t.get((f, 'before'), nan), t.get((f, 'after'), nan)
      cells += [f'{b:.2f}', f'{a:.2f}', f'{a / b:.2f}' if b else '-']
    print('| ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
  main()
