"""`aqtr-train` (or `python -m aqtr.train`): quantized vs float training.

Trains the same model on the same offline data (no download) under float,
int8 and fp8 (and a config of your own), then prints a summary table and
writes the outputs (see `aqtr.train.report`) to a fresh folder
`aqtr_train_out/<config>-<timestamp>` (printed at start), or to --out_dir
(which must be empty, or hold an earlier output and --overwrite be given).

  aqtr-train                                   # default: stdlib byte LM
  aqtr-train --config=config:digits            # MLP on sklearn digits
  aqtr-train --config=config:tiny --out_dir=/tmp/t
  aqtr-train --config=set:steps=500 --config=set:batch_size=32
  aqtr-train --config="set:runs=('float', 'int8_fwd')"
  aqtr-train --config="fiddler:custom('fully_quantized', bwd_bits=4)"
  aqtr-train --config="fiddler:custom('int8')" \\
    --config="fiddler:use_rounding('custom\\.d.hs\\.lhs', 'stochastic')"
  aqtr-train --config=config_file:aqtr_train_out/NAME/config.json  # rerun

--config directives apply in order; the first one may pick a named config
(`config:NAME`, NAME in `aqtr.train.experiment.CONFIGS`: default, tiny,
digits, long, large), else `config:default` is used. `set:` sets a field
by its dotted path (Python literals), `fiddler:` calls `custom` (a run of
your own config), a registry-name fiddler of `aqtr.fiddlers`, or any
importable dotted name.

Exit status: 0 all runs trained; 1 some run diverged (non-finite loss or
parameters; the others still ran and are reported); 2 a command-line
mistake (one line on stderr naming the flag and the valid choices); 130
interrupted (Ctrl-C: a line says where the partial results are).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence

from absl import app, flags

from aqtr.train import cli, experiment, job, loop, report

_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict:
  """Defines the job's flags once (not at import: no global side effects).

  Returns:
    {'config', 'out_dir', 'overwrite', 'progress', 'print_config',
    'import'} holders.
  """
  if _FLAGS:
    return _FLAGS
  _FLAGS['config'] = flags.DEFINE_multi_string(
    'config',
    [],
    'The experiment, built in order from directives: config:NAME '
    f'(NAME: {", ".join(experiment.CONFIGS)}; default when omitted), '
    'set:PATH=VALUE (e.g. set:steps=100), fiddler:NAME(ARGS) (NAME: '
    f"{', '.join(cli.fiddler_names())}; e.g. fiddler:custom('int8')), "
    'config_file:PATH (a config.json this job wrote). Runs: '
    f'{", ".join(experiment.RUNS)}.',
    flag_values=flag_values,
  )
  _FLAGS['out_dir'] = flags.DEFINE_string(
    'out_dir',
    None,
    'Output folder; must be empty or new (see --overwrite). Default: a '
    f'fresh {cli.DEFAULT_ROOT}/<config>-<YYYYmmdd-HHMMSS>.',
    flag_values=flag_values,
  )
  _FLAGS['overwrite'] = flags.DEFINE_bool(
    'overwrite',
    False,
    'Clear a non-empty --out_dir that holds an earlier aqtr-train output.',
    flag_values=flag_values,
  )
  _FLAGS['progress'] = flags.DEFINE_bool(
    'progress',
    True,
    'Show progress bars (on stderr).',
    flag_values=flag_values,
  )
  _FLAGS['print_config'] = flags.DEFINE_bool(
    'print_config',
    False,
    'Print the experiment config and exit.',
    flag_values=flag_values,
  )
  _FLAGS['import'] = flags.DEFINE_multi_string(
    'import',
    [],
    'Python file or module to import first (e.g. one that registers your '
    'own calibration for the fiddlers). Repeatable.',
    flag_values=flag_values,
  )
  return _FLAGS


def with_default_config(argv: Sequence[str]) -> list[str]:
  """`argv` with `--config=config:default` first when no base is given.

  Example:
    >>> with_default_config(['aqtr-train', '--config=set:steps=5'])[1:]
    ['--verbosity=-1', '--config=config:default', '--config=set:steps=5']
  """
  argv = list(argv)
  values = []
  for i, a in enumerate(argv):
    if a.startswith('--config='):
      values.append(a.removeprefix('--config='))
    elif a == '--config' and i + 1 < len(argv):
      values.append(argv[i + 1])
  if not any(v.startswith(cli.BASE_DIRECTIVES) for v in values):
    argv.insert(1, '--config=config:default')
  if not any(a.startswith(('--verbosity', '-v', '--v=')) for a in argv):
    argv.insert(1, '--verbosity=-1')  # absl WARNING: no orbax INFO lines.
  return argv


def _fail(message: str, status: int = 2) -> None:
  print(f'aqtr-train: {message}', file=sys.stderr, flush=True)
  sys.exit(status)


def _out_dir(f: dict, directives: Sequence[str]) -> str:
  if f['out_dir'].value:
    return f['out_dir'].value
  stamp = time.strftime('%Y%m%d-%H%M%S')
  return cli.default_out_dir(cli.config_name(directives), stamp)


def _main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    _fail(f'unexpected arguments: {" ".join(argv[1:])} (flags: --help)')
  f = define_flags()
  if f['import'].value:
    from aqtr import flags as aqtr_flags

    try:
      aqtr_flags.import_modules(f['import'].value)
    except (ImportError, OSError) as e:
      _fail(f'--import: {e}')
  directives = f['config'].value
  try:
    cfg = cli.config_from_directives(directives)
    cli.experiment_of(cfg)
  except cli.CommandLineError as e:
    _fail(str(e))
  if f['print_config'].value:
    from aqtr import fiddle as aqtr_fiddle

    print(aqtr_fiddle.to_text(job.resolved(cfg)))
    return
  out = _out_dir(f, directives)
  try:
    report.prepare_out_dir(out, f['overwrite'].value)
  except report.OutDirError as e:
    _fail(f'--out_dir: {e}')
  previous = signal.signal(signal.SIGINT, loop.request_stop)
  try:
    rows = job.run(cfg, out, show_progress=f['progress'].value)
  except KeyboardInterrupt:
    _fail(
      f'interrupted; partial results in {out} (what did not finish holds '
      f'a {report.INCOMPLETE} file)',
      130,
    )
  finally:
    signal.signal(signal.SIGINT, previous)
  diverged = [r['run'] for r in rows if r['status'] != 'ok']
  if diverged:
    _fail(f'run(s) diverged: {", ".join(diverged)}; see {out}', 1)


def _help_for(program: str) -> None:
  """Makes --help show this job's docstring and flags under any launcher.

  absl's --help prints `__main__`'s docstring and the flags defined by the
  module named `program`; a console script (`aqtr-train`) is neither.
  """
  launcher = sys.modules.get('__main__')
  if launcher is not None and not launcher.__doc__:
    launcher.__doc__ = __doc__
  for holder in _FLAGS.values():
    flags.FLAGS.register_key_flag_for_module(program, flags.FLAGS[holder.name])


def main(argv: Sequence[str] | None = None) -> None:
  """Entry point of `aqtr-train` and `python -m aqtr.train`."""
  argv = list(sys.argv if argv is None else argv)
  try:
    define_flags()
    _help_for(argv[0])
    app.run(_main, argv=with_default_config(argv))
  except KeyboardInterrupt:
    _fail('interrupted before training started; nothing was written', 130)


if __name__ == '__main__':
  main()
