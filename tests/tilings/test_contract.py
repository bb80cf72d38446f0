"""Contract test of the `tilings` registry.

Every registered name is tested the moment it registers with the checks of
`aqtr.testing.tilings` (see its docstring for the contract); BAD_FIELDS below
holds the bad-field examples, one entry per name.
"""

import pytest

from aqtr import tilings
from aqtr.testing import ContractError, check_registry
from aqtr.testing import tilings as contract
from tests.contract_cases import cases

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields
check_contract = contract.check_tiling

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# tiling needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'block2d': [
    {'tile_size': 0},
    {'free_size': -1},
    {'free_size': 2.0},
    {'tile_size': True},
  ],
  'per_channel': [],
  'per_tensor': [],
  'subchannel': [
    {'tile_size': -1},
    {'tile_size': 2.5},
    {'tile_size': True},
    {'tile_size': '128'},
    {'tile_count': -4},
    {'tile_count': 4.0},
    {'tile_size': 64, 'tile_count': 4},
  ],
}


# Every name runs every check but one of the two engine checks by default
# (tests/contract_cases.py); `-m slow` runs the full cross-product.
@pytest.mark.parametrize(('name', 'check'), cases(tilings.names(), CHECKS))
def test_contract(name, check):
  check(tilings.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(tilings.SubChannel, None)
  with pytest.raises(ContractError, match='add some'):
    check_bad_fields(tilings.SubChannel, [])
  check_bad_fields(tilings.PerTensor, [])


def test_registry():
  assert {'per_tensor', 'per_channel', 'subchannel'} <= set(tilings.names())
  check_registry(tilings, tilings.Tiling, unknown='per_row')
