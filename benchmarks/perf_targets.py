"""The performance figures of issue 36 against their targets, in one run.

Each figure is the ratio of two rows of the benchmark that measures it
(same process, same run), and the table says whether it meets its
target:

- compile, aqtr / Qwix (mlp, lm, pax; benchmarks/compile_time.py): CPU s
  of lower + compile, <= 0.85;
- int8 fwd+VJP at 1024^3 (dot_general.py): median ms over that of the
  three bare int8 dots, <= 1.05; with stochastic gradients, <= 1.20;
- train step, MLP and LM (train_step.py): float's min ms over int8's,
  >= 1.40;
- nf4 g64 fwd+bwd dot (subchannel_sum.py): median ms over the float
  dot's, <= 1.15;
- QLoRA step, Pax LM (lora.py): median ms over the LoRA step's, <= 1.05;
- the default test suite (`--suite`): wall s, <= 480; the peak resident
  memory of its largest process, <= 3 GB.

The benchmarks run as subprocesses with `--json` (the protocol of
benchmarks/before_after.py): on this working tree and, with `--rev`, on
the package `aqtr/` as it is at that git revision, alternately
(`--alternations`). A figure is a ratio of two rows of one run; over
several runs the table gives its median and, in brackets, its range.
`--suite` clones each side's commit (this side: HEAD, so commit first),
runs `CI=true pytest -q -n 2` there with this interpreter and PYTHONPATH
at the clone, and reads its wall time and the peak resident memory of
its largest process (8-11 minutes a side on this project's 2-core host;
`--suite-paths` runs a part). The compile figures need Qwix on
PYTHONPATH (`pip install qwix`); without it they read `n/a`.

Run: python benchmarks/perf_targets.py [--rev 471432b] [--alternations 3]
  [--only compile int8 train nf4 qlora] [--suite [--suite-paths P ...]]
  [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import before_after
import host

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each benchmark's command line; (full, quick) rounds fill `{rounds}`.
BENCHES = {
  'compile': (
    "benchmarks/compile_time.py --rows mlp lm pax --impls 'aqtr int8' "
    "'qwix int8' --rounds {rounds}",
    (3, 1),
  ),
  'int8': (
    'benchmarks/dot_general.py --modes fwd+vjp --shapes 1024x1024x1024 '
    "--impls 'aqtr int8' 'aqtr int8 sr' --rounds {rounds}",
    (9, 3),
  ),
  'train': (
    'benchmarks/train_step.py --models mlp lm --rounds {rounds}',
    (10, 3),
  ),
  'nf4': ('benchmarks/subchannel_sum.py --rounds {rounds}', (7, 2)),
  'qlora': (
    'benchmarks/lora.py --model pax --steps 3 --rounds {rounds}',
    (5, 2),
  ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figure:
  """`num[field] / den[field]` of one benchmark's rows, and its target.

  Attributes:
    name: the figure as the table names it.
    bench: a key of BENCHES.
    num: the text fields that pick the numerator's row.
    den: the same for the denominator's row.
    field: the numeric field divided.
    target: the bound the figure must meet.
    at_least: whether the figure must be >= target (else <=).
  """

  name: str
  bench: str
  num: dict
  den: dict
  field: str
  target: float
  at_least: bool = False


def _compile(row: str) -> Figure:
  return Figure(
    name=f'compile, aqtr / Qwix (CPU s of lower + compile): {row}',
    bench='compile',
    num={'row': row, 'impl': 'aqtr int8'},
    den={'row': row, 'impl': 'qwix int8'},
    field='cpu_s',
    target=0.85,
  )


def _ms(name: str, bench: str, num: dict, den: dict, target: float, **kw):
  return Figure(
    name=name, bench=bench, num=num, den=den, field='ms', target=target, **kw
  )


def _train(model: str, label: str) -> Figure:
  rows = (
    {'model': model, 'impl': 'float'},
    {'model': model, 'impl': 'aqtr int8'},
  )
  name = f'train step, x float (min ms): {label}'
  return _ms(name, 'train', *rows, 1.40, at_least=True)


_LIMIT = {'impl': 'int8 limit'}
FIGURES = (
  *(_compile(row) for row in ('mlp', 'lm', 'pax')),
  _ms(
    'int8 fwd+VJP 1024^3, x three bare int8 dots (median ms)',
    'int8',
    {'impl': 'aqtr int8'},
    _LIMIT,
    1.05,
  ),
  _ms(
    'same, stochastic gradients', 'int8', {'impl': 'aqtr int8 sr'}, _LIMIT, 1.20
  ),
  _train('mlp', 'MLP'),
  _train('lm', 'LM'),
  _ms(
    'nf4 g64 fwd+bwd dot, x float dot (median ms)',
    'nf4',
    {'config': 'nf4 g64 (weight only)'},
    {'config': 'float'},
    1.15,
  ),
  _ms(
    'QLoRA step / LoRA step, Pax LM (median ms)',
    'qlora',
    {'run': 'qlora_nf4'},
    {'run': 'lora'},
    1.05,
  ),
)
SUITE_S, SUITE_GB = 480.0, 3.0


def over_runs(values: list[float | str]) -> float | str | tuple:
  """A figure over runs: (median, lowest, highest), the one run's figure,
  or the first reason text.

  Each run's figure is a ratio of two rows of that one run; the median
  over runs is the figure, the range shows how far runs differ.

  Example:
    >>> over_runs([1.2, 1.0, 1.1])
    (1.1, 1.0, 1.2)
    >>> over_runs([1.2, 'n/a (no row)'])
    'n/a (no row)'
  """
  for v in values:
    if isinstance(v, str):
      return v
  if len(values) == 1:
    return values[0]
  return (statistics.median(values), min(values), max(values))


def value(fig: Figure, rows: list[dict]) -> float | str:
  """The figure from its benchmark's rows; a reason text where it has none.

  Example:
    >>> f = FIGURES[-1]
    >>> value(f, [{'run': 'lora', 'ms': 2.0}, {'run': 'qlora_nf4', 'ms': 2.1}])
    1.05
  """

  def one(pick):
    got = [r for r in rows if all(r.get(k) == v for k, v in pick.items())]
    return got[0] if len(got) == 1 else None

  num, den = one(fig.num), one(fig.den)
  if num is None or den is None:
    missing = ', '.join(
      f'{k}={v!r}'
      for pick, r in ((fig.num, num), (fig.den, den))
      if r is None
      for k, v in pick.items()
    )
    return f'n/a (no row {missing})'
  return round(num[fig.field] / den[fig.field], 4)


def met(x: float | str | tuple, target: float, at_least: bool) -> str:
  """'yes' / 'no' for a figure (or its median) against its target; '' for
  a reason text.

  Example:
    >>> met(1.2, 1.4, at_least=True), met((0.8, 0.7, 0.9), 0.85, False)
    ('no', 'yes')
  """
  x = x[0] if isinstance(x, tuple) else x
  if isinstance(x, str) or math.isnan(x):
    return ''
  return 'yes' if (x >= target if at_least else x <= target) else 'no'


def _cell(x: float | str | tuple) -> str:
  if isinstance(x, tuple):  # (median, low, high) over runs
    return f'{x[0]:.2f} ({x[1]:.2f}-{x[2]:.2f})'
  return x if isinstance(x, str) else f'{x:.2f}'


def table(
  figures: list[tuple[str, float | str, float | str, float | None, bool]],
  before: str | None,
  after: str,
) -> str:
  """Markdown: figure, [before,] after, target, met (of the after side).

  Args:
    figures: (name, before value, after value, target or None, at_least)
      per row.
    before: the before column's title; None for no before column.
    after: the after column's title.
  """
  cols = ['figure', *([before] if before else []), after, 'target', 'met']
  lines = [
    '| ' + ' | '.join(cols) + ' |',
    '|---|' + '---:|' * (len(cols) - 2) + '---|',
  ]
  for name, b, a, target, at_least in figures:
    cells = [name, *([_cell(b)] if before else []), _cell(a)]
    if target is None:
      cells += ['-', '']
    else:
      cells += [f'{">=" if at_least else "<="} {target:g}']
      cells += [met(a, target, at_least)]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def command(bench: str, quick: bool) -> list[str]:
  """The argv of `bench` (a key of BENCHES), with quick or full rounds."""
  line, (full, short) = BENCHES[bench]
  return shlex.split(line.format(rounds=short if quick else full))


def _log(msg: str) -> None:
  print(f'[{datetime.datetime.now():%H:%M:%S}] {msg}', file=sys.stderr)


def run_benches(benches, sides, alternations: int, quick: bool) -> dict:
  """{(bench, side): rows per run}; a failing run gets no rows."""
  runs: dict[tuple[str, str], list[list[dict]]] = {}
  for bench in benches:
    cmd = command(bench, quick)
    for i in range(alternations):
      for side, src in sides:
        _log(f'{bench} on {side} ({i + 1}/{alternations}): {shlex.join(cmd)}')
        t = time.perf_counter()
        try:
          got = before_after.rows(src, cmd)
        except subprocess.CalledProcessError as e:
          tail = (e.stderr or '').strip().splitlines()[-1:] or ['']
          _log(f'{bench} on {side} failed (rc {e.returncode}): {tail[0]}')
          got = []
        runs.setdefault((bench, side), []).append(got)
        _log(
          f'{bench} on {side}: {len(got)} rows in '
          f'{time.perf_counter() - t:.0f} s'
        )
  return runs


_TIMER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
with open(sys.argv[1], 'w') as log:
  run = subprocess.run(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({'rc': run.returncode, 'wall_s': wall, 'peak_kb': peak}))
"""


def suite(rev: str, paths: list[str]) -> dict:
  """The default suite (or `paths` of it) on a clone of `rev`: wall s,
  peak resident KB of its largest process, its summary line."""
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run(['git', 'clone', '-q', str(ROOT), tmp], check=True)
    subprocess.run(['git', '-C', tmp, 'checkout', '-q', rev], check=True)
    inherited = [p for p in [os.environ.get('PYTHONPATH')] if p]
    env = dict(
      os.environ, CI='true', PYTHONPATH=os.pathsep.join([tmp, *inherited])
    )
    where = subprocess.run(
      [sys.executable, '-c', 'import aqtr; print(aqtr.__file__)'],
      cwd=tmp,
      env=env,
      capture_output=True,
      text=True,
    ).stdout.strip()
    if not where.startswith(tmp):
      raise SystemExit(f'--suite: the clone of {rev} imports aqtr from {where}')
    log = pathlib.Path(tmp) / 'suite.log'
    pytest = [sys.executable, '-m', 'pytest', '-q', '-n', '2', '-p']
    pytest += ['no:cacheprovider']
    out = subprocess.run(
      [sys.executable, '-c', _TIMER, str(log), *pytest, *paths],
      cwd=tmp,
      env=env,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    lines = log.read_text().strip().splitlines()
    res['summary'] = lines[-1].strip('= ') if lines else ''
    return res


def run_suites(rev: str | None, paths: list[str]) -> tuple[list, list]:
  """The suite's rows (wall s, peak GB) for `rev` (if any) and HEAD."""
  res, notes = {}, []
  for side, r in ([('before', rev)] if rev else []) + [('now', 'HEAD')]:
    _log(f'suite on {side} ({r}): a clone, CI=true pytest -q -n 2 {paths}')
    res[side] = suite(r, paths)
    _log(f'suite on {side}: {res[side]["summary"]}')
    notes.append(f'suite {side}: {res[side]["summary"]} (rc {res[side]["rc"]})')
  what = f'suite part {" ".join(paths)}' if paths else 'default suite'
  # A part of the suite has no target.
  s_target, gb_target = (None, None) if paths else (SUITE_S, SUITE_GB)
  # A failing suite's time is no figure.
  wall = {
    s: r['wall_s'] if r['rc'] == 0 else f'n/a (pytest rc {r["rc"]})'
    for s, r in res.items()
  }
  gb = {s: r['peak_kb'] / 2**20 for s, r in res.items()}
  rows = [
    (
      f'{what}, `CI=true pytest -q -n 2`, wall s',
      wall.get('before'),
      wall['now'],
      s_target,
      False,
    ),
    (
      'largest pytest process, peak RSS GB',
      gb.get('before'),
      gb['now'],
      gb_target,
      False,
    ),
  ]
  return rows, notes


def _rev(rev: str) -> str:
  got = subprocess.run(
    ['git', 'rev-parse', '--verify', '-q', f'{rev}^{{commit}}'],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  if got.returncode:
    raise SystemExit(f'--rev: {rev!r} is no commit of this repository')
  return got.stdout.strip()[:7]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rev', help='the "before" git revision (default: none)')
  p.add_argument('--alternations', type=int, default=1)
  p.add_argument(
    '--only', nargs='+', choices=list(BENCHES), default=list(BENCHES)
  )
  p.add_argument('--suite', action='store_true', help='time the test suite')
  p.add_argument(
    '--suite-paths',
    nargs='*',
    default=[],
    help='test paths for --suite (default: the whole default suite)',
  )
  p.add_argument('--quick', action='store_true', help='fewer rounds')
  a = p.parse_args(argv)
  if a.alternations < 1:
    p.error(f'--alternations must be >= 1, got {a.alternations}')
  return a


def main(argv=None) -> None:
  a = parse_args(argv)
  head = _rev('HEAD')
  dirty = subprocess.run(
    ['git', 'status', '--porcelain', '--untracked-files=no'],
    cwd=ROOT,
    capture_output=True,
    text=True,
  ).stdout.strip()
  now = f'now ({head}{" + changes" if dirty else ""})'
  before = f'{_rev(a.rev)}' if a.rev else None
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    sides = [('now', ROOT)]
    if a.rev:
      before_after.unpack(a.rev, tmp)
      sides.insert(0, ('before', pathlib.Path(tmp)))
    got = run_benches(a.only, sides, a.alternations, a.quick)
  for fig in FIGURES:
    if fig.bench not in a.only:
      continue
    runs = {k: [value(fig, r) for r in got[(fig.bench, k)]] for k, _ in sides}
    b = over_runs(runs['before']) if a.rev else None
    rows.append(
      (
        fig.name,
        b,
        over_runs(runs['now']),
        fig.target,
        fig.at_least,
      )
    )
  notes = []
  if a.suite:
    suite_rows, notes = run_suites(a.rev, a.suite_paths)
    rows += suite_rows
    if dirty:
      notes.append(f'The suite ran {head}, without the uncommitted changes.')
  host.header('perf_targets.py')
  print(
    f'CPU flags: {host.cpu_flags()}; load {host.load_average()}; '
    f'{a.alternations} run(s) a side'
    + (': median (range)' if a.alternations > 1 else '')
  )
  print()
  print(table(rows, f'before ({before})' if before else None, now))
  for n in notes:
    print(f'\n{n}')


if __name__ == '__main__':
  main()
