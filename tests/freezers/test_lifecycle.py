"""Tests of aqtr.freezers.lifecycle helpers: names, keys, errors, bytes."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import aqtr
from aqtr.freezers import (
  CalibrationFreezer,
  Mode,
  NoFreezer,
  WeightsFreezer,
  lifecycle,
)


def test_configure_sets_forward_freezers_by_name_or_instance():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int8(), lhs='calibration', rhs=WeightsFreezer()
  )
  assert cfg.fwd.lhs.freezer == CalibrationFreezer()
  assert cfg.fwd.rhs.freezer == WeightsFreezer()
  assert cfg.dlhs.lhs.freezer == NoFreezer()
  assert aqtr.freezers.configure(cfg) == cfg
  with pytest.raises(TypeError, match='rhs must be a Freezer'):
    aqtr.freezers.configure(cfg, rhs=3)
  with pytest.raises(KeyError, match='registered names'):
    aqtr.freezers.configure(cfg, rhs='bogus')


def test_freezers_only_on_forward_operands():
  cfg = aqtr.presets.int8()
  bad = aqtr.DotGeneralConfig(
    fwd=cfg.fwd,
    dlhs=cfg.dlhs,
    drhs=aqtr.DotGeneralRaw(
      lhs=aqtr.TensorConfig(freezer=WeightsFreezer()),
      rhs=cfg.drhs.rhs,
      use_fwd_quant=True,
    ),
  )
  with pytest.raises(ValueError, match=r'config\.drhs\.lhs\.freezer'):
    lifecycle.validate(bad)
  with pytest.raises(TypeError, match='DotGeneralConfig'):
    lifecycle.validate('int8')


def test_fingerprint_is_stable_and_tracks_the_forward_config():
  a = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  assert lifecycle.entry_name(a) == lifecycle.entry_name(
    aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  )
  assert lifecycle.entry_name(a).startswith('frozen_')
  # Backward-only changes do not matter for serving; forward ones do.
  b = aqtr.freezers.configure(aqtr.presets.int8_fwd(), rhs='weights')
  assert lifecycle.fingerprint(a) == lifecycle.fingerprint(b)
  c = aqtr.freezers.configure(aqtr.presets.int4_weight_only(), rhs='weights')
  assert lifecycle.fingerprint(a) != lifecycle.fingerprint(c)
  # The same in a fresh interpreter (no hash randomization).
  code = (
    'import aqtr; from aqtr.freezers import lifecycle; '
    'print(lifecycle.fingerprint(aqtr.freezers.configure('
    "aqtr.presets.int8(), rhs='weights')))"
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == lifecycle.fingerprint(a)


def test_find_frozen_errors_name_the_collection_and_the_fix():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  name = lifecycle.entry_name(cfg)
  assert lifecycle.find_frozen({name: 1}, cfg, 'op', 'aqtr', 'fix') == 1
  with pytest.raises(ValueError, match=r"collection 'aqtr'.*none\. fix"):
    lifecycle.find_frozen(None, cfg, 'op', 'aqtr', 'fix')
  with pytest.raises(ValueError, match='frozen_00000000.*different'):
    lifecycle.find_frozen({'frozen_00000000': 1}, cfg, 'op', 'aqtr', 'fix')


def test_key_use():
  plain = aqtr.presets.int8()
  sr = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
  assert lifecycle.key_use(plain, Mode.TRAIN) is None
  assert lifecycle.key_use(sr, Mode.TRAIN) == 'required'
  for mode in (Mode.CALIBRATE, Mode.CONVERT, Mode.SERVE):
    assert lifecycle.key_use(sr, mode) == 'dummy'


def test_nbytes_counts_int4_packed():
  tree = {
    'a': jnp.zeros((4, 4), jnp.int8),
    'b': jnp.zeros((4, 4), jnp.int4),
    'c': jnp.zeros((2,), jnp.float32),
    'd': jax.ShapeDtypeStruct((3,), jnp.bfloat16),
    'k': jax.random.key(0),  # key data: 2 x uint32
  }
  assert lifecycle.nbytes(tree) == 16 + 8 + 8 + 6 + 8


def test_import_aqtr_does_not_import_flax_or_lifecycle():
  code = (
    'import sys, aqtr; '
    "print(any(m == 'flax' or m.startswith('flax.') for m in sys.modules), "
    "'aqtr.freezers.lifecycle' in sys.modules)"
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  assert out.stdout.split() == ['False', 'False']
