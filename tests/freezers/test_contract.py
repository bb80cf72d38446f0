"""Contract test of the `freezers` registry.

Every registered name is tested the moment it registers with the checks of
`aqtr.testing.freezers` (see its docstring for the contract); BAD_FIELDS below
holds the bad-field examples, one entry per name.
"""

import pytest

from aqtr import freezers
from aqtr.testing import ContractError, check_registry
from aqtr.testing import freezers as contract

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields
check_contract = contract.check_freezer

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# freezer needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'calibration': [
    {'per_channel': 1},
    {'per_channel': 'yes'},
    {'per_channel': None},
  ],
  'none': [],
  'sparse_weights': [],
  'weights': [],
}


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', freezers.names())
def test_contract(name, check):
  check(freezers.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(freezers.NoFreezer, None)
  check_bad_fields(freezers.NoFreezer, [])


def test_registry():
  assert 'none' in freezers.names()
  check_registry(freezers, freezers.Freezer, unknown='frozen')
