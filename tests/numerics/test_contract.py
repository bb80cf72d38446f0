"""Contract test of the `numerics` registry.

Every registered name is tested the moment it registers with the checks of
`aqtr.testing.numerics` (see its docstring for the contract); BAD_FIELDS below
holds the bad-field examples, one entry per name.
"""

import pytest

from aqtr import numerics
from aqtr.testing import ContractError, check_registry
from aqtr.testing import numerics as contract

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields
check_contract = contract.check_numerics

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# numerics needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'fp8': [
    {'dtype_name': 'float16'},
    {'dtype_name': 'e4m3'},
  ],
  'int_symmetric': [
    {'bits': 0},
    {'bits': 9},
    {'bits': 16},
    {'bits': True},
    {'bits': 2.5},
    {'bits': 1, 'preserve_zero': True},
    {'storage': 'int2'},
    {'storage': 'int4', 'bits': 8},
  ],
  'nf4': [],
  'none': [],
  'ternary': [
    {'clip_gradient': 1},
    {'clip_gradient': 'yes'},
  ],
}


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', numerics.names())
def test_contract(name, check):
  check(numerics.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(numerics.IntSymmetric, None)
  with pytest.raises(ContractError, match='add some'):
    check_bad_fields(numerics.IntSymmetric, [])
  check_bad_fields(numerics.NoNumerics, [])


def test_registry():
  assert {'none', 'int_symmetric', 'fp8'} <= set(numerics.names())
  check_registry(numerics, numerics.Numerics, unknown='int9')
