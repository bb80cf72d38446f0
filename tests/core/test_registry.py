"""Tests for aqtr.Registry and the four family registries."""

from __future__ import annotations

import abc
import dataclasses

import pytest

import aqtr
from aqtr import calibrations, freezers, numerics, tilings


@dataclasses.dataclass(frozen=True, kw_only=True)
class Base(abc.ABC):
  @abc.abstractmethod
  def run(self):
    """What a family's algorithms do."""


def _cls(name='Thing', base=Base, **fields):
  """A frozen kw-only dataclass subclassing `base` (same qualname per name)."""
  ns = {'__annotations__': {k: int for k in fields}, **fields}
  ns['run'] = lambda self: None
  cls = type(name, (base,), ns)
  cls.__module__ = __name__
  cls.__qualname__ = name
  return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@pytest.fixture
def reg():
  return aqtr.Registry('things', Base)


def test_register_get_names(reg):
  a = reg.register('alpha')(_cls('Alpha'))
  b = reg.register('beta')(_cls('Beta', size=1))
  assert reg.get('alpha') is a and reg.get('beta') is b
  assert reg.names() == ('alpha', 'beta')
  assert 'alpha' in reg and 'gamma' not in reg
  assert a.registered_name == 'alpha'
  assert 'alpha' in repr(reg) and 'things' in repr(reg)


def test_unknown_name_lists_registered_names(reg):
  reg.register('beta')(_cls('Beta'))
  reg.register('alpha')(_cls('Alpha'))
  with pytest.raises(aqtr.UnknownNameError) as info:
    reg.get('gamma')
  msg = str(info.value)
  assert "'gamma'" in msg and 'alpha, beta' in msg and 'things' in msg
  assert isinstance(info.value, KeyError)
  with pytest.raises(KeyError):
    reg.get(['not', 'hashable'])


def test_duplicate_name_raises(reg):
  reg.register('alpha')(_cls('Alpha'))
  with pytest.raises(ValueError, match="'alpha' is already registered"):
    reg.register('alpha')(_cls('Other'))


def test_reregistering_the_same_qualname_replaces(reg):
  """A notebook cell run twice defines a new class with the same name."""
  first = reg.register('alpha')(_cls('Alpha'))
  second = reg.register('alpha')(_cls('Alpha', size=2))
  assert first is not second
  assert reg.get('alpha') is second


def test_name_must_be_an_identifier(reg):
  for bad in ('', 'has space', '1abc', 3):
    with pytest.raises(ValueError, match='identifier'):
      reg.register(bad)


def test_registered_classes_must_follow_the_rules(reg):
  class NotSub:
    pass

  with pytest.raises(TypeError, match='must subclass'):
    reg.register('x')(NotSub)

  class Plain(Base):  # inherits Base's dataclass params, is not one itself
    extra: int = 1

    def run(self):
      pass

  with pytest.raises(TypeError, match='frozen=True, kw_only=True'):
    reg.register('x')(Plain)

  @dataclasses.dataclass(frozen=True)
  class Positional(Base):
    a: int = 1

  with pytest.raises(TypeError, match='kw_only'):
    reg.register('x')(Positional)

  class Root:
    pass

  @dataclasses.dataclass(kw_only=True)
  class Mutable(Root):
    pass

  with pytest.raises(TypeError, match='frozen'):
    aqtr.Registry('mutables', Root).register('x')(Mutable)

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class NoDefault(Base):
    a: int

  with pytest.raises(TypeError, match="field 'a'.*needs a default"):
    reg.register('x')(NoDefault)
  assert reg.names() == ()


@pytest.mark.parametrize(
  'module,expected',
  [
    (calibrations, {'absmax', 'constant'}),
    (numerics, {'none', 'int_symmetric', 'fp8'}),
    (tilings, {'per_tensor', 'per_channel', 'subchannel'}),
    (freezers, {'none'}),
  ],
  ids=['calibrations', 'numerics', 'tilings', 'freezers'],
)
def test_family_registries(module, expected):
  assert expected <= set(module.names())
  assert module.names() == tuple(sorted(module.names()))
  for name in module.names():
    cls = module.get(name)
    assert issubclass(cls, module.registry.base)
    assert cls.registered_name == name
    assert module.get(name) is module.registry.get(name)
  with pytest.raises(aqtr.UnknownNameError, match=', '.join(module.names())):
    module.get('no_such_algorithm')


def test_family_classes_are_reachable_by_name():
  assert calibrations.get('absmax') is calibrations.AbsMax
  assert calibrations.get('constant') is calibrations.Constant
  assert numerics.get('int_symmetric') is numerics.IntSymmetric
  assert numerics.get('fp8') is numerics.Fp8
  assert numerics.get('none') is numerics.NoNumerics
  assert tilings.get('per_channel') is tilings.PerChannel
  assert tilings.get('per_tensor') is tilings.PerTensor
  assert tilings.get('subchannel') is tilings.SubChannel
  assert freezers.get('none') is freezers.NoFreezer


def test_family_register_rejects_other_families():
  with pytest.raises(TypeError, match='must subclass'):
    calibrations.register('wrong_family')(tilings.PerChannel)
  assert 'wrong_family' not in calibrations.names()
