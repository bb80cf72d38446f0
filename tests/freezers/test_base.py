"""Tests of aqtr.freezers.base: the Mode enum, Freezer and NoFreezer."""

import dataclasses

import pytest

import aqtr
from aqtr import freezers
from aqtr.freezers import Freezer, Mode, NoFreezer


def test_modes_are_the_four_life_cycle_steps():
  assert [m.value for m in Mode] == ['train', 'calibrate', 'convert', 'serve']
  assert Mode('serve') is Mode.SERVE and Mode['CONVERT'] is Mode.CONVERT
  assert aqtr.Mode is Mode
  with pytest.raises(ValueError, match='deploy'):
    Mode('deploy')


def test_freezer_is_an_abstract_frozen_base():
  with pytest.raises(TypeError, match='abstract'):
    Freezer()
  assert Freezer.__dataclass_params__.frozen
  assert Freezer.frozen_parts == () and Freezer.collects is False


def test_no_freezer_stores_nothing_in_any_mode():
  f = NoFreezer()
  assert all(f.stores(m) == () for m in Mode)
  assert dataclasses.fields(f) == ()
  assert freezers.get('none') is NoFreezer
  assert f == NoFreezer() and hash(f) == hash(NoFreezer())


def test_no_freezer_rejects_a_non_mode():
  with pytest.raises(TypeError, match=r'mode must be an aqtr\.freezers\.Mode'):
    NoFreezer().stores('serve')


def test_tensor_config_defaults_to_no_freezer():
  assert aqtr.TensorConfig().freezer == NoFreezer()
  with pytest.raises(TypeError, match=r'TensorConfig\.freezer'):
    aqtr.TensorConfig(freezer='none')
