"""Contract test of the `transforms` registry.

Every registered name is tested the moment it registers with the checks of
`aqtr.testing.transforms` (see its docstring for the contract); BAD_FIELDS
below holds the bad-field examples, one entry per name.
"""

import pytest

from aqtr import transforms
from aqtr.testing import ContractError, check_registry
from aqtr.testing import transforms as contract

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# transform needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'hadamard': [
    {'block_size': 24},
    {'block_size': 1},
    {'block_size': 2048},
    {'block_size': 16.0},
    {'block_size': True},
    {'signs': 'random'},
    {'seed': -1},
    {'seed': 1.5},
    {'method': 'fft'},
  ],
  'none': [],
}


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', transforms.names())
def test_contract(name, check):
  check(transforms.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(transforms.Hadamard, None)
  with pytest.raises(ContractError, match='add some'):
    check_bad_fields(transforms.Hadamard, [])
  check_bad_fields(transforms.NoTransform, [])


def test_registry():
  assert {'none', 'hadamard'} <= set(transforms.names())
  check_registry(transforms, transforms.Transform, unknown='rotation')
