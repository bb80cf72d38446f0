"""Optional gin bindings for the config tree (needs the `gin` extra).

`import aqtr.gin` makes these gin configurables (the core never imports
gin):

  aqtr.DotGeneralConfig, aqtr.DotGeneralRaw, aqtr.TensorConfig,
  aqtr.NearestEven, aqtr.Stochastic
  aqtr.<family>.<name> for every registered name, family in numerics,
    calibrations, tilings, sparsity, freezers, transforms:
    `aqtr.calibrations.absmax`,
    `aqtr.numerics.int_symmetric`, ... (gin also accepts a unique suffix
    such as `calibrations.absmax`).

Each configurable returns an instance of the class itself (not a gin
subclass), so gin-built configs compare equal to Fiddle-built ones.
Algorithms registered after the import (your own file) are added by
`register_all()`, which `config_from_gin` calls. configs/gin/int8.gin and
fp8.gin spell the presets out; scopes name the position (`dlhs/lhs/...`).

`config_from_gin('configs/gin/fp8.gin') == aqtr.presets.fp8()`.

Example (bindings only; files work the same way):
  >>> import aqtr, aqtr.gin, gin
  >>> gin.clear_config()
  >>> cfg = aqtr.gin.config_from_gin(bindings=[
  ...   'aqtr.DotGeneralConfig.fwd = @aqtr.DotGeneralRaw()',
  ...   'aqtr.DotGeneralRaw.rhs = @aqtr.TensorConfig()',
  ...   'aqtr.TensorConfig.numerics = @aqtr.numerics.int_symmetric()',
  ...   'aqtr.numerics.int_symmetric.bits = 4'])
  >>> cfg.fwd.rhs.numerics.bits, cfg.fwd.lhs.numerics.bits
  (4, 8)
  >>> gin.clear_config()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from aqtr import extras

try:
  import gin
except ImportError as e:
  raise extras.missing('gin', 'aqtr.gin', e) from e

from aqtr import (
  calibrations,
  freezers,
  numerics,
  sparsity,
  tilings,
  transforms,
)
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.rounding import NearestEven, Stochastic

__all__ = ['config_from_gin', 'configurable', 'register_all']

_FAMILIES = {
  'aqtr.numerics': numerics.registry,
  'aqtr.calibrations': calibrations.registry,
  'aqtr.tilings': tilings.registry,
  'aqtr.sparsity': sparsity.registry,
  'aqtr.freezers': freezers.registry,
  'aqtr.transforms': transforms.registry,
}
_CLASSES = (
  DotGeneralConfig,
  DotGeneralRaw,
  TensorConfig,
  NearestEven,
  Stochastic,
)

# 'module.name' -> (class, its gin configurable).
_REGISTERED: dict[str, tuple[type, Callable[..., Any]]] = {}


def _factory(cls: type) -> Callable[..., Any]:
  """A function with `cls`'s signature that returns a plain `cls`."""

  def make(**kwargs: Any) -> Any:
    return cls(**kwargs)

  make.__signature__ = inspect.signature(cls)
  make.__name__ = make.__qualname__ = cls.__name__
  make.__doc__ = cls.__doc__
  return make


def _register(cls: type, module: str, name: str) -> None:
  key = f'{module}.{name}'
  if key in _REGISTERED:
    return
  with gin.unlock_config():  # Parsing a file locks gin's config.
    fn = gin.external_configurable(_factory(cls), name=name, module=module)
  _REGISTERED[key] = (cls, fn)


def register_all() -> tuple[str, ...]:
  """Makes every registered algorithm a gin configurable; idempotent.

  Returns:
    All aqtr gin names, e.g. 'aqtr.calibrations.absmax'.
  """
  for cls in _CLASSES:
    _register(cls, 'aqtr', cls.__name__)
  for module, registry in _FAMILIES.items():
    for name in registry.names():
      _register(registry.get(name), module, name)
  return tuple(sorted(_REGISTERED))


def configurable(name: str) -> Callable[..., Any]:
  """The gin configurable registered as `name` ('aqtr.TensorConfig').

  Calling it builds the class with the current gin bindings.
  """
  register_all()
  if name not in _REGISTERED:
    raise KeyError(
      f'No aqtr gin configurable {name!r}; known: {", ".join(_REGISTERED)}.'
    )
  return _REGISTERED[name][1]


def config_from_gin(
  *files: str, bindings: Sequence[str] = ()
) -> DotGeneralConfig:
  """Parses gin `files` and `bindings` and builds `aqtr.DotGeneralConfig`.

  The files are added to gin's global config, which is left unlocked (call
  `gin.clear_config()` first for a fresh one).

  Args:
    *files: paths of .gin files.
    bindings: extra binding lines, e.g. "aqtr.numerics.int_symmetric.bits=4".

  Returns:
    The DotGeneralConfig the bindings describe.
  """
  register_all()
  with gin.unlock_config():
    gin.parse_config_files_and_bindings(
      list(files), list(bindings), finalize_config=False
    )
  return configurable('aqtr.DotGeneralConfig')()


register_all()
