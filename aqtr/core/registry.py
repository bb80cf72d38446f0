"""Registry: a name index over the classes of one algorithm family.

The registry maps short names ('absmax', 'int_symmetric', ...) to classes so
gin, the command line, logs and the contract tests can refer to algorithms by
name. Code and Fiddle configs refer to the classes themselves.

Example:
  >>> from aqtr import calibrations
  >>> calibrations.get('absmax').__name__
  'AbsMax'
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar('T', bound=type)


class UnknownNameError(KeyError):
  """Raised by `Registry.get` for a name that is not registered."""

  def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
    return str(self.args[0])


class Registry(Generic[T]):
  """Names -> classes for one family (calibrations, numerics, ...).

  Args:
    family: the family name used in error messages, e.g. 'calibrations'.
    base: every registered class must subclass it.
  """

  def __init__(self, family: str, base: type):
    self.family = family
    self.base = base
    self._classes: dict[str, type] = {}

  def register(self, name: str) -> Callable[[T], T]:
    """Class decorator registering `cls` under `name`.

    Registering a different class under a taken name raises; re-registering
    a class with the same `module.qualname` (a notebook cell run twice)
    replaces the old one.
    """
    if not isinstance(name, str) or not name.isidentifier():
      raise ValueError(
        f'{self.family}: name must be a Python identifier, got {name!r}.'
      )

    def decorator(cls: T) -> T:
      if not (isinstance(cls, type) and issubclass(cls, self.base)):
        raise TypeError(
          f'{self.family}.register({name!r}): {cls!r} must subclass '
          f'{self.base.__module__}.{self.base.__qualname__}.'
        )
      # Own params only: an undecorated subclass inherits its parent's.
      params = cls.__dict__.get('__dataclass_params__')
      kw_only = params is not None and all(
        f.kw_only for f in dataclasses.fields(cls) if f.init
      )
      if params is None or not (params.frozen and kw_only):
        raise TypeError(
          f'{self.family}.register({name!r}): {cls.__qualname__} must be '
          '@dataclasses.dataclass(frozen=True, kw_only=True).'
        )
      for f in dataclasses.fields(cls):
        no_default = (
          f.default is dataclasses.MISSING
          and f.default_factory is dataclasses.MISSING
        )
        if no_default and f.init:
          raise TypeError(
            f'{self.family}.register({name!r}): field {f.name!r} of '
            f'{cls.__qualname__} needs a default.'
          )
      old = self._classes.get(name)
      if old is not None and _key(old) != _key(cls):
        raise ValueError(
          f'{self.family}: name {name!r} is already registered to '
          f'{_key(old)}; cannot register {_key(cls)} under it.'
        )
      self._classes[name] = cls
      cls.registered_name = name
      return cls

    return decorator

  def get(self, name: str) -> type:
    """The class registered under `name`; unknown names list the valid ones."""
    try:
      return self._classes[name]
    except (KeyError, TypeError):
      raise UnknownNameError(
        f'Unknown {self.family} name {name!r}; registered names: '
        f'{", ".join(self.names())}.'
      ) from None

  def names(self) -> tuple[str, ...]:
    """All registered names, sorted."""
    return tuple(sorted(self._classes))

  def __contains__(self, name: object) -> bool:
    return name in self._classes

  def __repr__(self) -> str:
    return f'Registry({self.family!r}, names={self.names()})'


def family(name: str) -> Registry:
  """The registry of family `name` ('numerics', 'freezers', ...).

  Imports the family package `aqtr.<name>` on first use, so the core can
  name algorithms without importing the families (which import the core).
  """
  return importlib.import_module(f'aqtr.{name}').registry


def factory(family_name: str, name: str) -> Callable[[], object]:
  """A `default_factory`: the registered class `name` built with defaults.

  Example:
    >>> factory('numerics', 'int_symmetric')().bits
    8
  """

  def build():
    return family(family_name).get(name)()

  build.__qualname__ = build.__name__ = f'{family_name}_{name}'
  return build


def _key(cls: type) -> str:
  return f'{cls.__module__}.{cls.__qualname__}'
