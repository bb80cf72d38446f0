"""`aqtr-train` (or `python -m aqtr.train`): quantized vs float training.

Trains the same model on the same offline data (no download) under float,
int8 and fp8 (and a config of your own), then prints a summary table and
writes the outputs (see `aqtr.train.report`) to --out_dir.

  aqtr-train                                   # default: stdlib byte LM
  aqtr-train --config=config:digits            # MLP on sklearn digits
  aqtr-train --config=config:tiny --out_dir=/tmp/t
  aqtr-train --config=set:steps=500 --config=set:batch_size=32
  aqtr-train --config="set:runs=('float', 'int8_fwd')"
  aqtr-train --config="fiddler:custom('fully_quantized', bwd_bits=4)"
  aqtr-train --config="fiddler:custom('int8')" \\
    --config="fiddler:use_rounding('custom\\.d.hs\\.lhs', 'stochastic')"
  aqtr-train --config=config_file:aqtr_train_out/config.json   # rerun

--config directives apply in order; the first one may pick a named config
(`config:NAME`, NAME from `aqtr.train.experiment`: default, tiny, digits,
large), else `config:default` is used. `set:` sets a field by its dotted
path (Python literals), `fiddler:` calls a function of
`aqtr.train.experiment` (`custom`, and the registry-name fiddlers of
`aqtr.fiddlers`) or any importable dotted name.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import app, flags
from fiddle import absl_flags as fdl_flags

from aqtr.train import experiment, job

_BASE = ('config:', 'config_file:', 'config_str:')

_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict:
  """Defines the job's flags once (not at import: no global side effects).

  Returns:
    {'config', 'out_dir', 'progress', 'print_config', 'import'} holders.
  """
  if _FLAGS:
    return _FLAGS
  _FLAGS['config'] = fdl_flags.DEFINE_fiddle_config(
    'config',
    default_module=experiment,
    allow_imports=True,
    help_string=(
      'The experiment, built in order from directives: config:NAME '
      '(default, tiny, digits, large; default when omitted), '
      'set:PATH=VALUE (e.g. set:steps=100), fiddler:NAME(ARGS) (e.g. '
      "fiddler:custom('int8')), config_file:PATH (a config.json this job "
      'wrote).'
    ),
    flag_values=flag_values,
  )
  _FLAGS['out_dir'] = flags.DEFINE_string(
    'out_dir',
    'aqtr_train_out',
    'Output folder (files in it are replaced).',
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
  if not any(v.startswith(_BASE) for v in values):
    argv.insert(1, '--config=config:default')
  if not any(a.startswith(('--verbosity', '-v', '--v=')) for a in argv):
    argv.insert(1, '--verbosity=-1')  # absl WARNING: no orbax INFO lines.
  return argv


def _main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  f = define_flags()
  if f['import'].value:
    from aqtr import flags as aqtr_flags

    aqtr_flags.import_modules(f['import'].value)
  cfg = f['config'].value
  if f['print_config'].value:
    from aqtr import fiddle as aqtr_fiddle

    print(aqtr_fiddle.to_text(job.resolved(cfg)))
    return
  job.run(cfg, f['out_dir'].value, show_progress=f['progress'].value)


def main(argv: Sequence[str] | None = None) -> None:
  """Entry point of `aqtr-train` and `python -m aqtr.train`."""
  define_flags()
  app.run(_main, argv=with_default_config(sys.argv if argv is None else argv))


if __name__ == '__main__':
  main()
