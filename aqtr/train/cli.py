"""What `aqtr-train` does with its flags: directives, output folder, errors.

`--config` directives are applied one at a time (`config_from_directives`)
so that a mistake is reported as one line naming the directive and the
valid choices (`CommandLineError`), never as a traceback. Named configs are
`aqtr.train.experiment.CONFIGS`; fiddlers are `custom` and the
registry-name fiddlers of `aqtr.fiddlers` (and `stock_rule`, the rules of
the stock-model run); dotted names are imported.

Without `--out_dir` every job writes to a fresh folder
`aqtr_train_out/<config>-<YYYYmmdd-HHMMSS>` (`default_out_dir`); an
existing, non-empty `--out_dir` is refused unless `--overwrite` is given
(and then only when it holds an earlier aqtr-train output).

Example:
  >>> from aqtr.train import cli
  >>> cfg = cli.config_from_directives(['config:tiny', 'set:steps=3'])
  >>> cfg.steps
  3
  >>> cli.config_from_directives(['config:tiny', 'set:stepz=3'])
  Traceback (most recent call last):
  ...
  aqtr.train.cli.CommandLineError: --config=set:stepz=3: Experiment has no \
field 'stepz'; fields: task, model, runs, custom, steps, batch_size, ...
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
from collections.abc import Sequence
from typing import Any

import fiddle as fdl
from absl import flags
from fiddle import absl_flags as fdl_flags

from aqtr import fiddlers
from aqtr.train import experiment, stock_lm

__all__ = [
  'BASE_DIRECTIVES',
  'CommandLineError',
  'DEFAULT_ROOT',
  'config_from_directives',
  'config_name',
  'default_out_dir',
  'experiment_of',
  'fiddler_names',
]

BASE_DIRECTIVES = ('config:', 'config_file:', 'config_str:')
DEFAULT_ROOT = 'aqtr_train_out'
_OTHER = ('set:', 'fiddler:')


class CommandLineError(ValueError):
  """A command-line mistake; the message is one line naming the flag."""


def fiddler_names() -> tuple[str, ...]:
  """The bare names `--config=fiddler:NAME(...)` accepts."""
  return ('custom', *fiddlers.__all__, 'stock_rule', 'high_precision')


def _namespace() -> types.ModuleType:
  """What bare names resolve to: the named configs and the fiddlers."""
  names = types.ModuleType('aqtr.train.names', 'Configs and fiddlers.')
  for name, fn in experiment.CONFIGS.items():
    setattr(names, name, fn)
  names.custom = experiment.custom
  names.stock_rule = stock_lm.stock_rule
  names.high_precision = experiment.high_precision
  for name in fiddlers.__all__:
    setattr(names, name, getattr(fiddlers, name))
  return names


def _one_line(err: BaseException, limit: int = 400) -> str:
  text = ' '.join(str(err).split()) or type(err).__name__
  return text if len(text) <= limit else text[: limit - 3] + '...'


def _call_name(expression: str) -> str:
  return expression.split('(', 1)[0].strip()


def _check(directive: str, cfg: Any) -> None:
  """Raises CommandLineError for a directive that cannot apply to `cfg`."""
  command, _, expr = directive.partition(':')
  flag = f'--config={directive}'
  if f'{command}:' not in BASE_DIRECTIVES + _OTHER:
    raise CommandLineError(
      f'{flag}: a directive starts with one of '
      f'{", ".join(BASE_DIRECTIVES + _OTHER)}'
    )
  if cfg is not None and f'{command}:' in BASE_DIRECTIVES:
    raise CommandLineError(
      f'{flag}: only one base config (config:, config_file:) is allowed, '
      'and it comes first'
    )
  name = _call_name(expr)
  if command == 'config' and '.' not in name:
    if name not in experiment.CONFIGS:
      raise CommandLineError(
        f'{flag}: unknown config {name!r}; named configs: '
        f'{", ".join(experiment.CONFIGS)} (or config_file:PATH)'
      )
  elif command == 'fiddler' and '.' not in name:
    if name not in fiddler_names():
      raise CommandLineError(
        f'{flag}: unknown fiddler {name!r}; fiddlers: '
        f'{", ".join(fiddler_names())} (or a dotted module.function)'
      )
  elif command == 'config_file':
    path = pathlib.Path(expr)
    if not path.is_file():
      raise CommandLineError(
        f'{flag}: no such file {str(path)!r} (give the config.json an '
        'earlier aqtr-train wrote)'
      )
  elif command == 'set' and _is_experiment(cfg):
    field = re.split(r'[.\[=]', expr, maxsplit=1)[0].strip()
    names = [f.name for f in dataclasses.fields(experiment.Experiment)]
    if field not in names:
      raise CommandLineError(
        f'{flag}: Experiment has no field {field!r}; fields: '
        f'{", ".join(names)}.'
      )


def _is_experiment(cfg: Any) -> bool:
  return (
    isinstance(cfg, fdl.Config)
    and fdl.get_callable(cfg) is experiment.Experiment
  )


def config_from_directives(directives: Sequence[str]) -> fdl.Config:
  """Applies `--config` directives in order; the first picks the base.

  Args:
    directives: e.g. ['config:tiny', 'set:steps=5', "fiddler:custom('fp8')"].
      Without a base directive first, `config:default` is used.

  Returns:
    The `fdl.Config(Experiment)` (not validated: see `experiment_of`).

  Raises:
    CommandLineError: one line naming the directive and the valid choices.
  """
  directives = list(directives)
  if not directives or not directives[0].startswith(BASE_DIRECTIVES):
    directives.insert(0, 'config:default')
  flag = fdl_flags.FiddleFlag(
    name='config',
    default=None,
    parser=flags.ArgumentParser(),
    serializer=None,
    help_string='',
    default_module=_namespace(),
    allow_imports=True,
  )
  cfg = None
  for directive in directives:
    _check(directive, cfg)
    try:
      flag.parse(directive)
      cfg = flag.value
    except Exception as e:  # Reported in one line.
      raise CommandLineError(f'--config={directive}: {_one_line(e)}') from e
  if not _is_experiment(cfg):
    raise CommandLineError(
      f'--config={directives[0]}: not an aqtr-train experiment (a '
      f'fdl.Config of Experiment), got {_one_line(repr(cfg), 120)}'
    )
  return cfg


def experiment_of(cfg: fdl.Config) -> experiment.Experiment:
  """Builds and validates the experiment; CommandLineError on a bad field."""
  try:
    return experiment.split(cfg)[0]
  except Exception as e:  # Reported in one line.
    text = _one_line(e).removeprefix('<root> (Experiment): ')
    raise CommandLineError(f'--config: {text}') from e


def config_name(directives: Sequence[str]) -> str:
  """A folder-friendly name of the base config: 'default', 'digits', 'rerun'.

  Example:
    >>> config_name(['config:digits', 'set:steps=5'])
    'digits'
  """
  base = next((d for d in directives if d.startswith(BASE_DIRECTIVES)), None)
  if base is None:
    return 'default'
  if not base.startswith('config:'):
    return 'rerun'
  name = _call_name(base.removeprefix('config:')).rsplit('.', 1)[-1]
  return re.sub(r'[^A-Za-z0-9_-]', '_', name) or 'config'


def default_out_dir(name: str, stamp: str, root: str = DEFAULT_ROOT) -> str:
  """`root/name-stamp`, with -2, -3, ... appended when that one exists.

  Example:
    >>> default_out_dir('tiny', '20260101-120000', '/nonexistent')
    '/nonexistent/tiny-20260101-120000'
  """
  base = pathlib.Path(root) / f'{name}-{stamp}'
  path, i = base, 1
  while path.exists():
    i += 1
    path = base.with_name(f'{base.name}-{i}')
  return str(path)
