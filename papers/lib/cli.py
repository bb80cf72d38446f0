"""The command line of every reproduction: `aqtr-train`'s `--config` flags.

`python -m papers.<claim>.run` takes the same `--config` directives as
`aqtr-train`, resolved against the claim's `config.py`: `config:NAME` (a
function of it: `full`, `small`), `set:PATH=VALUE`, `fiddler:NAME(ARGS)`
(the claim's own functions, `aqtr.fiddlers`' and `papers.lib.compare.
add_run`, without importing them in `config.py`), `config_file:PATH`;
then `--out_dir` (default: the claim's folder, where README's table and
plot live), `--import` (user code, e.g. a registered calibration) and
`--save_config=PATH` (the config as JSON, for `config_file:PATH`).

Example:
  >>> from papers.int8_training_matches_float import config
  >>> cfg, out = parse(config, ['run', '--config=config:small',
  ...                           "--config=set:tasks['digits'].steps=7"])
  >>> cfg.tasks['digits'].steps, out
  (7, None)
"""

from __future__ import annotations

import pathlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import fiddle as fdl
from absl import flags
from fiddle import absl_flags as fdl_flags

from aqtr import fiddle as aqtr_fiddle
from aqtr import fiddlers as aqtr_fiddlers
from aqtr import flags as aqtr_flags
from papers.lib import compare

__all__ = ['main', 'namespace', 'parse', 'write']


def namespace(config_module: types.ModuleType) -> types.ModuleType:
  """`config_module` with the shared fiddlers added: what `--config` sees.

  Names: `aqtr.fiddlers`' (`use_numerics`, `set_fields`, ...),
  `papers.lib.compare.add_run`, then the module's own (which win).

  Example:
    >>> from papers.int8_training_matches_float import config
    >>> ns = namespace(config)
    >>> ns.small is config.small, callable(ns.use_rounding)
    (True, True)
  """
  ns = types.ModuleType(config_module.__name__, config_module.__doc__)
  ns.__dict__.update(
    {n: getattr(aqtr_fiddlers, n) for n in aqtr_fiddlers.__all__}
  )
  ns.add_run = compare.add_run
  ns.__dict__.update(
    {k: v for k, v in vars(config_module).items() if not k.startswith('__')}
  )
  return ns


def _define(config_module: types.ModuleType, fv: flags.FlagValues) -> dict:
  return {
    'config': fdl_flags.DEFINE_fiddle_config(
      'config',
      default_module=namespace(config_module),
      allow_imports=True,
      help_string='config:NAME (full, small), set:PATH=VALUE, '
      'fiddler:NAME(ARGS), config_file:PATH; applied in order.',
      flag_values=fv,
    ),
    'out_dir': flags.DEFINE_string(
      'out_dir',
      None,
      'Output folder (default: the claim folder).',
      flag_values=fv,
    ),
    'import': aqtr_flags.DEFINE_imports(flag_values=fv),
    'save_config': flags.DEFINE_string(
      'save_config',
      None,
      'Also write the config as JSON to this file '
      '(reread with --config=config_file:PATH).',
      flag_values=fv,
    ),
  }


def parse(
  config_module: types.ModuleType, argv: Sequence[str]
) -> tuple[fdl.Config, str | None]:
  """(config, out_dir) from command-line `argv` (argv[0] is the program).

  `config:full` applies first when no `config:` / `config_file:` is given.
  `--save_config=PATH` writes the resulting config as JSON.
  """
  argv = list(argv)
  given = [
    a.removeprefix('--config=') for a in argv if a.startswith('--config=')
  ]
  if not any(v.startswith(('config:', 'config_file:')) for v in given):
    argv.insert(1, '--config=config:full')
  fv = flags.FlagValues()
  f = _define(config_module, fv)
  fv(argv)
  aqtr_flags.import_modules(f['import'].value)
  cfg = f['config'].value
  if f['save_config'].value:
    pathlib.Path(f['save_config'].value).write_text(aqtr_fiddle.dumps(cfg))
  return cfg, f['out_dir'].value


def write(out: pathlib.Path, cfg: fdl.Config, table: str) -> None:
  """Writes results.md (the table) and config.txt (every leaf).

  With `--save_config`, `main` also writes config.json, which
  `--config=config_file:PATH` reads back.
  """
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.md').write_text(table + '\n')
  (out / 'config.txt').write_text(aqtr_fiddle.to_text(cfg) + '\n')


def main(
  config_module: types.ModuleType,
  run: Callable[[fdl.Config, pathlib.Path], Any],
  argv: Sequence[str] | None = None,
) -> None:
  """Parses flags, runs `run(cfg, out_dir)`, prints where the outputs are."""
  cfg, out = parse(config_module, sys.argv if argv is None else argv)
  folder = pathlib.Path(config_module.__file__).parent
  out = pathlib.Path(out) if out else folder
  run(cfg, out)
  print(f'outputs: {out}/results.md, {out}/results.png')
