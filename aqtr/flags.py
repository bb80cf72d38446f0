"""Command-line flags for aqtr configs (fiddle.absl_flags).

Needs the `flags` extra (`pip install 'aqtr[flags]'`: fiddle[flags]). One
`--config` flag, given several times, builds a Fiddle config step by step,
in order:

  --config=config:int8                 a preset, as `aqtr.fiddle.config`
  --config='config:fully_quantized(fwd_bits=4)'
  --config=config:my_module.my_config  any function returning a fdl.Config
  --config="fiddler:use_rounding('dlhs.lhs', 'stochastic')"
  --config="fiddler:set_tag('BwdBits', 4)"
  --config=set:dlhs.lhs.numerics.bits=4   a Python literal at a path
  --config=config_file:run.json        a config saved by aqtr.fiddle.dumps

Bare names are the presets (`int8`, `fp8`, ...) and the fiddlers of
`aqtr.fiddlers`. Dotted names are imported, so configs and
fiddlers in your own modules work too. `--import=path/to/file.py` (or a
module name) imports your code first, so that what it registers (e.g. a
calibration) is known by name to the fiddlers.

Example script (configs/sweep.py is a complete one):

  from absl import app
  import aqtr
  from aqtr import flags as aqtr_flags

  _CONFIG = aqtr_flags.DEFINE_config()
  _IMPORTS = aqtr_flags.DEFINE_imports()

  def main(argv):
    aqtr_flags.import_modules(_IMPORTS.value)
    print(aqtr.fiddle.to_text(_CONFIG.value))

  app.run(main)
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import fiddle as fdl
from absl import flags

from aqtr import extras

try:
  from fiddle import absl_flags as fdl_flags
except ImportError as e:
  raise extras.missing('flags', 'aqtr.flags', e) from e

from aqtr import fiddle as aqtr_fiddle
from aqtr import fiddlers, presets

_HELP = (
  'The aqtr config, built in order from config:PRESET (e.g. config:int8), '
  "fiddler:NAME(ARGS) (e.g. fiddler:use_rounding('dlhs.lhs', 'stochastic'))"
  ' and set:PATH=VALUE (e.g. set:fwd.lhs.numerics.bits=4) directives. '
  f'Presets: {", ".join(presets.__all__)}.'
)


def DEFINE_config(  # Absl's naming.
  name: str = 'config',
  *,
  help_string: str = _HELP,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> flags.FlagHolder:
  """Defines the multi-directive Fiddle config flag `--name`.

  Args:
    name: the flag's name.
    help_string: its help text.
    flag_values: where to define it (a fresh `flags.FlagValues()` in tests).

  Returns:
    A holder whose `.value` is the resulting `fdl.Config` (None when the
    flag was not given). Directives are applied when `.value` is first
    read, so call `import_modules` before that.
  """
  return fdl_flags.DEFINE_fiddle_config(
    name,
    default=None,
    help_string=help_string,
    default_module=_NAMES,
    flag_values=flag_values,
    allow_imports=True,
  )


def DEFINE_imports(  # Absl's naming.
  name: str = 'import',
  *,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> flags.FlagHolder:
  """Defines `--name=FILE.py|MODULE` (repeatable): user code to import."""
  return flags.DEFINE_multi_string(
    name,
    [],
    'Python file or module to import before the config is resolved, e.g. '
    'one that registers your own calibration. Repeatable.',
    flag_values=flag_values,
  )


def import_modules(specs: Sequence[str]) -> list[types.ModuleType]:
  """Imports each spec: a path to a `.py` file, or a dotted module name.

  A file is imported as a module named after its stem (`my_calibration`),
  once, and kept in `sys.modules` so that serialized configs that refer to
  its classes load again.

  Example:
    >>> import_modules(['json'])[0].__name__
    'json'
  """
  modules = []
  for spec in specs:
    if spec.endswith('.py') or '/' in spec:
      modules.append(_import_file(pathlib.Path(spec)))
    else:
      modules.append(importlib.import_module(spec))
  return modules


def _import_file(path: pathlib.Path) -> types.ModuleType:
  path = path.resolve()
  if not path.is_file():
    raise FileNotFoundError(f'--import: no such file {path}.')
  name = path.stem
  old = sys.modules.get(name)
  if old is not None and pathlib.Path(getattr(old, '__file__', '')) == path:
    return old
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def _preset(name: str) -> Callable[..., fdl.Config]:
  def fn(*args: Any, **kwargs: Any) -> fdl.Config:
    return aqtr_fiddle.config(name, *args, **kwargs)

  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = f'`aqtr.presets.{name}` as a Fiddle config.'
  return fn


# What bare names in config:NAME and fiddler:NAME resolve to.
_NAMES = types.ModuleType('aqtr.flags.names', 'Presets and fiddlers.')
for _name in presets.__all__:
  setattr(_NAMES, _name, _preset(_name))
for _name in fiddlers.__all__:
  setattr(_NAMES, _name, getattr(fiddlers, _name))
