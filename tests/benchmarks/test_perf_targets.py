"""benchmarks/perf_targets.py: its figures, table and arguments."""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).parents[2] / 'benchmarks'
sys.path.insert(0, str(BENCH))  # The scripts import each other by name.

import perf_targets as pt  # noqa: E402


def test_every_figure_reads_a_benchmark_that_prints_json_rows():
  assert {f.bench for f in pt.FIGURES} == set(pt.BENCHES)
  for bench in pt.BENCHES:
    for quick in (False, True):
      argv = pt.command(bench, quick)
      script = BENCH.parent / argv[0]
      assert script.exists(), argv
      assert "'--json'" in script.read_text(), f'{argv[0]} takes no --json'
      assert argv[argv.index('--rounds') + 1].isdigit()
  assert int(pt.command('int8', True)[-1]) < int(pt.command('int8', False)[-1])


def test_over_runs_is_median_and_range_or_the_reason():
  assert pt.over_runs([1.3, 1.1, 1.2, 1.0]) == (1.15, 1.0, 1.3)
  assert pt.over_runs([0.9]) == 0.9
  assert pt.over_runs([1.0, 'n/a (no row x)']) == 'n/a (no row x)'


def _rows():
  return [
    {'model': 'mlp', 'impl': 'float', 'ms': 30.0},
    {'model': 'mlp', 'impl': 'aqtr int8', 'ms': 20.0},
    {'model': 'lm', 'impl': 'float', 'ms': 30.0},
  ]


def test_value_divides_the_picked_rows_and_names_a_missing_one():
  mlp, lm = (f for f in pt.FIGURES if f.bench == 'train')
  assert pt.value(mlp, _rows()) == 1.5
  got = pt.value(lm, _rows())
  assert got == "n/a (no row model='lm', impl='aqtr int8')", got
  # Two rows matching one pick are no figure either.
  assert pt.value(mlp, _rows() + [_rows()[1]]).startswith('n/a')


def test_met_reads_the_targets_direction():
  assert pt.met(1.5, 1.4, at_least=True) == 'yes'
  assert pt.met(1.3, 1.4, at_least=True) == 'no'
  assert pt.met(0.9, 0.85, at_least=False) == 'no'
  assert pt.met(0.85, 0.85, at_least=False) == 'yes'
  assert pt.met('n/a (no row)', 0.85, at_least=False) == ''
  assert pt.met(float('nan'), 0.85, at_least=False) == ''
  assert pt.met((1.41, 1.2, 1.5), 1.4, at_least=True) == 'yes'  # the median


def test_table_with_and_without_a_before_column():
  rows = [
    ('compile mlp', 1.35, 1.18, 0.85, False),
    ('train MLP', 1.21, 'n/a (no row x)', 1.4, True),
    ('suite part', 30.0, 25.0, None, False),
    ('int8', (1.1, 1.05, 1.2), (1.13, 1.12, 1.2), 1.05, False),
  ]
  text = pt.table(rows, 'before (471432b)', 'now (abc1234)')
  lines = text.splitlines()
  assert lines[0] == (
    '| figure | before (471432b) | now (abc1234) | target | met |'
  )
  assert lines[2] == '| compile mlp | 1.35 | 1.18 | <= 0.85 | no |'
  assert lines[3] == '| train MLP | 1.21 | n/a (no row x) | >= 1.4 |  |'
  assert lines[4] == '| suite part | 30.00 | 25.00 | - |  |'
  assert lines[5] == (
    '| int8 | 1.10 (1.05-1.20) | 1.13 (1.12-1.20) | <= 1.05 | no |'
  )
  one = pt.table(rows[:1], None, 'now').splitlines()
  assert one[0] == '| figure | now | target | met |'
  assert one[2] == '| compile mlp | 1.18 | <= 0.85 | no |'


@pytest.mark.parametrize(
  'argv, where',
  [
    (['--only', 'speed'], '--only'),
    (['--alternations', '0'], '--alternations'),
  ],
)
def test_bad_arguments_are_one_line(argv, where, capsys):
  with pytest.raises(SystemExit):
    pt.parse_args(argv)
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert where in err, err


def test_unknown_rev_is_one_line():
  with pytest.raises(SystemExit, match="--rev: 'no-such-rev' is no commit"):
    pt.main(['--rev', 'no-such-rev', '--only', 'nf4'])


def test_suite_rows_name_a_failed_run_and_a_part_has_no_target(monkeypatch):
  runs = {
    'old': {'rc': 0, 'wall_s': 600.0, 'peak_kb': 5 * 2**20, 'summary': 's'},
    'HEAD': {'rc': 1, 'wall_s': 400.0, 'peak_kb': 2 * 2**20, 'summary': 'f'},
  }
  monkeypatch.setattr(pt, 'suite', lambda rev, paths: runs[rev])
  rows, notes = pt.run_suites('old', [])
  assert rows[0][1:] == (600.0, 'n/a (pytest rc 1)', pt.SUITE_S, False)
  assert rows[1][1:] == (5.0, 2.0, pt.SUITE_GB, False)
  assert notes == ['suite before: s (rc 0)', 'suite now: f (rc 1)']
  rows, _ = pt.run_suites(None, ['tests/core'])
  assert rows[0][0].startswith('suite part tests/core')
  assert rows[0][1:] == (None, 'n/a (pytest rc 1)', None, False)
