"""Tests of aqtr.calibrations.base: the base class, guard and registry.

The registration rules are tested on the calibrations
registry, with every registration undone after each test.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations
from aqtr.calibrations.base import nonfinite_guard


@pytest.fixture
def registry(monkeypatch):
  """The calibrations registry; registrations are undone afterwards."""
  reg = calibrations.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  return reg


def _calibration(name='Scratch', **namespace):
  """A valid calibration class named `name` (qualname test_base.Scratch)."""
  namespace.setdefault('calibrate', lambda self, x, axes: x)
  namespace.setdefault('__annotations__', {})
  namespace.setdefault('__module__', __name__)
  namespace.setdefault('__qualname__', name)
  cls = type(name, (calibrations.Calibration,), namespace)
  return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def test_base_is_abstract_with_po2_scale():
  with pytest.raises(TypeError, match='abstract'):
    calibrations.Calibration()
  fields = {
    f.name: f.default for f in dataclasses.fields(calibrations.Calibration)
  }
  assert fields == {'po2_scale': False}


def test_nonfinite_guard():
  x = jnp.ones((4, 3)).at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
  x = x.at[2, 0].set(-jnp.inf)
  g = nonfinite_guard(x, (1,))
  assert g.shape == (4, 1) and g.dtype == x.dtype
  assert jnp.isnan(g[:3]).all()
  np.testing.assert_array_equal(g[3], 0.0)
  np.testing.assert_array_equal(nonfinite_guard(x, (0, 1)).shape, (1, 1))


def test_unknown_name_lists_the_registered_names():
  with pytest.raises(aqtr.UnknownNameError, match='absmax, constant') as err:
    calibrations.get('nope')
  assert "Unknown calibrations name 'nope'" in str(err.value)
  with pytest.raises(aqtr.UnknownNameError):
    calibrations.get(['not', 'hashable'])


def test_duplicate_name_for_a_different_class_raises(registry):
  registry.register('scratch')(_calibration('Scratch'))
  with pytest.raises(ValueError, match="'scratch' is already registered") as e:
    registry.register('scratch')(_calibration('Other'))
  assert f'{__name__}.Scratch' in str(e.value)
  assert f'{__name__}.Other' in str(e.value)
  with pytest.raises(ValueError, match='already registered'):
    registry.register('absmax')(_calibration('Scratch'))


def test_reregistering_the_same_qualname_replaces_it(registry):
  first = registry.register('scratch')(_calibration('Scratch'))
  second = registry.register('scratch')(_calibration('Scratch'))  # reload
  assert first is not second
  assert calibrations.get('scratch') is second
  assert second.registered_name == 'scratch'


def test_registered_classes_must_subclass_the_base(registry):
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class NotACalibration:
    pass

  with pytest.raises(TypeError, match='must subclass'):
    registry.register('scratch')(NotACalibration)
  with pytest.raises(TypeError, match='must subclass'):
    registry.register('scratch')(calibrations.AbsMax())


def test_registered_classes_must_be_kw_only(registry):
  # A frozen dataclass with a positional field.
  cls = dataclasses.dataclass(frozen=True)(
    type(
      'Positional',
      (calibrations.Calibration,),
      {
        'calibrate': lambda self, x, axes: x,
        '__annotations__': {'c': float},
        'c': 1.0,
      },
    )
  )
  with pytest.raises(TypeError, match='frozen=True, kw_only=True'):
    registry.register('scratch')(cls)
  assert 'scratch' not in calibrations.names()


def test_registered_classes_must_be_decorated_themselves(registry):
  # It inherits AbsMax's __dataclass_params__, yet its new default is no
  # field: Undecorated() silently keeps clip_scale=1.0.
  class Undecorated(calibrations.AbsMax):
    clip_scale: float = 0.5

  assert Undecorated().clip_scale == 1.0
  with pytest.raises(TypeError, match='frozen=True, kw_only=True'):
    registry.register('scratch')(Undecorated)


def test_registered_fields_need_defaults(registry):
  cls = _calibration('NoDefault', __annotations__={'c': float})
  with pytest.raises(TypeError, match="field 'c' of NoDefault needs a default"):
    registry.register('scratch')(cls)


@pytest.mark.parametrize('name', ['has space', '1abc', '', 3, None])
def test_names_must_be_identifiers(registry, name):
  with pytest.raises(ValueError, match='must be a Python identifier'):
    registry.register(name)
