"""Contract test of the `calibrations` registry.

Every registered calibration is tested the moment it registers with the
checks of `aqtr.testing.calibrations` (see its docstring for the contract);
BAD_FIELDS below holds the bad-field examples, one entry per name.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations
from aqtr.testing import ContractError, check_registry, stateful
from aqtr.testing import calibrations as contract
from tests.contract_cases import cases

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields
check_contract = contract.check_calibration

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# calibration needs an entry ([] only without fields beyond po2_scale).
BAD_FIELDS = {
  'absmax': [
    {'clip_scale': 0.0},
    {'clip_scale': -1.0},
    {'clip_scale': math.nan},
    {'clip_scale': math.inf},
    {'clip_scale': True},
    {'clip_scale': '1'},
  ],
  'minmax': [],
  'delayed_scaling': [
    {'history_length': 0},
    {'history_length': 2.0},
    {'history_length': True},
  ],
  'ema_stats': [
    {'p': 0.0},
    {'c1': -1.0},
    {'c0': math.nan},
    {'c1': 0.0},  # all four coefficients 0: the bound would be 0
    {'c1': 0.0, 'c3': 0.0},
    {'ema_update_count': 0},
    {'prior_count': -1.0},
    {'exclude_zeros': 1},
    {'freeze_step': -1},
  ],
  'lsq': [{'po2_scale': 1}],
  'mean_absmax': [{'po2_scale': 'yes'}],
  'pact': [
    {'init_clip': 0.0},
    {'init_clip': math.nan},
    {'init_clip': '1'},
    {'l2': -1.0},
    {'l2': math.inf},
    {'l2': 'x'},
  ],
  'constant': [
    {'bound': 0.0},
    {'bound': -2.0},
    {'bound': math.inf},
    {'bound': math.nan},
    {'bound': False},
    {'bound': 'x'},
  ],
  'mse': [
    {'steps': 1},
    {'steps': 2.5},
    {'steps': True},
    {'rounds': 0},
    {'rounds': '2'},
  ],
  'percentile': [
    {'q': 0.0},
    {'q': 100.5},
    {'q': math.nan},
    {'q': '99'},
    {'q': True},
    {'method': 'quantile'},
    {'bins': 1},
    {'bins': 8.0},
  ],
  'rms': [
    {'p': 0.5},
    {'p': math.inf},
    {'p': True},
    {'c': 0.0},
    {'c': -1.0},
    {'c': math.nan},
    {'c': '3'},
  ],
}


# Every name runs every check but one of the two engine checks by default
# (tests/contract_cases.py); `-m slow` runs the full cross-product.
@pytest.mark.parametrize(('name', 'check'), cases(calibrations.names(), CHECKS))
def test_contract(name, check):
  check(calibrations.get(name), BAD_FIELDS.get(name))


@pytest.mark.slow
@pytest.mark.parametrize(
  'name',
  [
    n
    for n in calibrations.names()
    if issubclass(calibrations.get(n), calibrations.StatefulCalibration)
  ],
)
def test_stateful_jit_equals_eager(name):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)
  stateful.run(calibrations.get(name)(), x, w, eager=True)


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(calibrations.AbsMax, None)
  with pytest.raises(ContractError, match='add some'):
    check_bad_fields(calibrations.AbsMax, [])


def test_registry():
  assert {'absmax', 'constant'} <= set(calibrations.names())
  check_registry(calibrations, calibrations.Calibration, unknown='abs_max')


@pytest.fixture
def scratch_registry(monkeypatch):
  """Registrations made during the test are undone afterwards."""
  reg = calibrations.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  return reg


def test_a_calibration_registered_here_passes_the_contract(scratch_registry):
  @calibrations.register('test_rms')
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Rms(calibrations.Calibration):
    """bound = c * sqrt(mean_G x^2): a root-mean-square (k-sigma) range."""

    c: float = 3.0

    def __post_init__(self):
      if not (isinstance(self.c, float) and self.c > 0):
        raise ValueError(f'Rms.c must be a float > 0, got {self.c!r}.')

    def calibrate(self, x, axes):
      return self.c * jnp.sqrt(jnp.mean(x * x, axis=tuple(axes), keepdims=True))

  assert 'test_rms' in calibrations.names()
  assert calibrations.get('test_rms') is Rms
  check_contract(Rms, [{'c': 0.0}, {'c': 1}])
  # Usable through a config, like any built-in calibration.
  t = aqtr.TensorConfig(calibration=calibrations.get('test_rms')(c=2.0))
  x = jnp.asarray(np.random.default_rng(3).normal(0, 3, (4, 64)), jnp.float32)
  qt = aqtr.quantize(x, t)
  rms = jnp.sqrt(jnp.mean(x * x, axis=1))
  np.testing.assert_allclose(qt.scale.ravel(), 2.0 * rms / 127, rtol=1e-6)
  assert (jnp.abs(qt.qvalue.astype(jnp.int32)) <= 127).all()


def test_a_registered_calibration_without_examples_fails(scratch_registry):
  @calibrations.register('test_untested')
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Untested(calibrations.AbsMax):
    pass

  with pytest.raises(ContractError, match='add an entry'):
    test_contract('test_untested', check_bad_fields)


def test_scratch_registrations_do_not_leak():
  assert 'test_rms' not in calibrations.names()
  assert 'test_untested' not in calibrations.names()
