"""Contract test of the `sparsity` registry.

Every registered name is tested with the checks of `aqtr.testing.sparsity`
(see its docstring for the contract); BAD_FIELDS below holds the bad-field
examples, one entry per name.
"""

import pytest

from aqtr import sparsity
from aqtr.testing import ContractError, check_registry
from aqtr.testing import sparsity as contract

CHECKS = contract.CHECKS

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# sparsity needs an entry ([] only for a class without fields).
_SCHEDULE = [
  {'start_step': -1},
  {'start_step': 1.5},
  {'update_step': 0},
  {'update_step': True},
  {'decay': -0.1},
  {'decay': float('inf')},
  {'decay': 'big'},
]
BAD_FIELDS = {
  'magnitude': [
    {'keep': 0.0},
    {'keep': 1.5},
    {'keep': True},
    {'granularity': 'column'},
    *_SCHEDULE,
  ],
  'n_m': [
    {'n': 4, 'm': 4},
    {'n': 5},
    {'n': 0},
    {'m': 1},
    {'m': 512},
    {'m': 4.0},
    {'block': 0},
    {'offset': -1},
    {'offset': 1.0},
    *_SCHEDULE,
  ],
  'none': [],
}


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', sparsity.names())
def test_contract(name, check):
  check(sparsity.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    contract.check_bad_fields(sparsity.NM, None)
  with pytest.raises(ContractError, match='add some'):
    contract.check_bad_fields(sparsity.NM, [])
  contract.check_bad_fields(sparsity.NoSparsity, [])


def test_registry():
  assert set(sparsity.names()) == {'none', 'n_m', 'magnitude'}
  check_registry(sparsity, sparsity.Sparsity, unknown='two_four')
