"""`aqtr-train` command-line mistakes, output folders and exit statuses.

Most cases call `main()` in this process (no training starts, so each is
fast); one real subprocess checks that no traceback reaches the terminal.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from absl import flags

from aqtr.train import cli, experiment, job, report
from aqtr.train.__main__ import define_flags, main


def _main(capsys, *args):
  """(exit status, stdout, stderr) of `aqtr-train ARGS` run in-process."""
  define_flags()
  flags.FLAGS.unparse_flags()
  with pytest.raises(SystemExit) as e:
    main(['aqtr-train', *args])
  out, err = capsys.readouterr()
  return e.value.code or 0, out, err


@pytest.fixture
def regular_file(tmp_path):
  path = tmp_path / 'file'
  path.write_text('x')
  return path


CASES = [
  (['--config=config:nosuch'], 'config:nosuch', 'default, tiny, digits, long'),
  (['--config=set:steps=-3'], '--config: steps', '>= 1, got -3'),
  (['--config=set:steps=2.5'], '--config: steps', 'an int >= 1, got 2.5'),
  (['--config=set:steps="abc"'], '--config: steps', "got 'abc'"),
  (['--config=set:learning_rate=-1.0'], 'learning_rate', '> 0, got -1.0'),
  (['--config=set:no_such_field=1'], 'no_such_field', 'fields: task, model'),
  (["--config=set:runs=('float', 'int9')"], "'int9'", 'float, fp8'),
  (["--config=fiddler:nosuch('x')"], 'fiddler:nosuch', 'custom, set_fields'),
  (['--config=config_file:/no/such.json'], 'config_file:', '/no/such.json'),
  (['--config=config:tiny', '--config=config:digits'], 'one base', ''),
  (['--config=nonsense'], 'nonsense', 'config:, config_file:'),
  (['--out_dir={file}/out'], '--out_dir', '{file}/out'),
  (['stray'], 'unexpected arguments: stray', ''),
]


@pytest.mark.parametrize('args, names, choices', CASES)
def test_mistakes_exit_2_with_one_line(
  capsys, regular_file, args, names, choices
):
  args = [a.format(file=regular_file) for a in args]
  status, out, err = _main(capsys, *args, '--print_config=false')
  lines = err.strip().splitlines()
  assert status == 2 and out == ''
  assert len(lines) == 1, err
  assert lines[0].startswith('aqtr-train: ')
  assert names in lines[0] and choices.format(file=regular_file) in lines[0]
  assert '_lm' not in lines[0]


def test_console_script_help_lists_configs_runs_and_fiddlers():
  script = (
    'import sys; from aqtr.train.__main__ import main; '
    "sys.argv[0] = 'aqtr-train'; main()"
  )  # What the installed `aqtr-train` launcher does.
  proc = subprocess.run(
    [sys.executable, '-c', script, '--help'],
    capture_output=True,
    text=True,
    timeout=120,
  )
  text = ' '.join(proc.stdout.split())
  assert 'Exit status: 0 all runs trained' in text
  help_line = text[text.index('--config: ') :]
  for name in (*experiment.CONFIGS, *experiment.RUNS, *cli.fiddler_names()):
    assert name in help_line
  assert 'long' in experiment.CONFIGS and '_lm' not in help_line


def test_print_config_names_functions(capsys):
  status, out, err = _main(capsys, '--config=config:digits', '--print_config')
  assert status == 0 and err == ''
  assert 'model.activation = aqtr.train.models.relu' in out
  assert ' at 0x' not in out


def test_out_dir_is_fresh_or_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  first = cli.default_out_dir('tiny', '20260101-000000')
  assert first == os.path.join(cli.DEFAULT_ROOT, 'tiny-20260101-000000')
  report.prepare_out_dir(first)
  (tmp_path / first / 'x').write_text('old')
  again = cli.default_out_dir('tiny', '20260101-000000')
  assert again.endswith('tiny-20260101-000000-2')
  with pytest.raises(report.OutDirError, match='not empty.*--overwrite'):
    report.prepare_out_dir(first)
  with pytest.raises(report.OutDirError, match='no aqtr-train output'):
    report.prepare_out_dir(first, overwrite=True)  # Not ours: kept.
  assert (tmp_path / first / 'x').read_text() == 'old'
  report.mark_incomplete(tmp_path / first, 'this job')
  report.prepare_out_dir(first, overwrite=True)
  assert list((tmp_path / first).iterdir()) == []
  assert cli.config_name(['config_file:a/config.json']) == 'rerun'
  assert cli.config_name(["config:my.module.cfg(x='/')"]) == 'cfg'


def test_nonempty_out_dir_is_refused_before_training(capsys, tmp_path):
  (tmp_path / 'old_run').mkdir()
  status, _, err = _main(
    capsys, '--config=config:tiny', f'--out_dir={tmp_path}'
  )
  assert status == 2 and '--overwrite' in err and len(err.splitlines()) == 1


def test_diverged_run_exits_1(capsys, monkeypatch, tmp_path):
  rows = [{'run': 'float', 'status': 'ok'}, {'run': 'int8', 'status': 'x'}]
  monkeypatch.setattr(job, 'run', lambda *a, **k: rows)
  status, _, err = _main(capsys, f'--out_dir={tmp_path / "o"}')
  assert status == 1 and 'diverged: int8' in err


def test_interrupt_says_where_partial_results_are(
  capsys, monkeypatch, tmp_path
):
  def interrupted(*a, **k):
    raise KeyboardInterrupt

  monkeypatch.setattr(job, 'run', interrupted)
  status, _, err = _main(capsys, f'--out_dir={tmp_path / "o"}')
  assert status == 130 and 'Traceback' not in err
  assert f'partial results in {tmp_path / "o"}' in err


def test_subprocess_mistake_has_no_traceback(tmp_path):
  proc = subprocess.run(
    [sys.executable, '-m', 'aqtr.train', '--config=set:seq_len=1'],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    timeout=120,
  )
  assert proc.returncode == 2 and proc.stdout == ''
  assert proc.stderr.strip() == (
    'aqtr-train: --config: seq_len must be an int >= 2, got 1.'
  )
  assert not (tmp_path / cli.DEFAULT_ROOT).exists()


def test_sigint_leaves_marked_partial_results(tmp_path):
  out = tmp_path / 'o'
  proc = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'aqtr.train',
      '--config=config:tiny',
      "--config=set:runs=('float',)",
      '--noprogress',
      f'--out_dir={out}',
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert proc.stdout.readline() == f'output: {out}\n'
    deadline = time.monotonic() + 120
    while not (out / 'float' / report.INCOMPLETE).exists():
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 130, err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1
  assert f'partial results in {out}' in err
  assert (out / report.INCOMPLETE).is_file()
  assert (out / 'float' / report.INCOMPLETE).is_file()
  assert not (out / 'summary.md').exists()
