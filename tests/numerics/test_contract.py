"""Contract test of the `numerics` registry.

Every registered name is tested the moment it registers with the checks of
`aqtr.testing.numerics` (see its docstring for the contract); BAD_FIELDS below
holds the bad-field examples, one entry per name.
"""

import pytest

from aqtr import numerics
from aqtr.testing import ContractError, check_registry
from aqtr.testing import numerics as contract
from tests.contract_cases import cases

CHECKS = contract.CHECKS
check_bad_fields = contract.check_bad_fields
check_contract = contract.check_numerics

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# numerics needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'fp': [
    {'exponent_bits': 0},
    {'exponent_bits': 6},
    {'mantissa_bits': 11},
    {'mantissa_bits': 2.0},
    {'encoding': 'e4m3'},
    {'encoding': 'fn', 'mantissa_bits': 0},
  ],
  'fp8': [
    {'dtype_name': 'float16'},
    {'dtype_name': 'e4m3'},
  ],
  'int_asymmetric': [
    {'bits': 1},
    {'bits': 9},
    {'bits': 4.0},
    {'storage': 'int4'},
    {'clip_gradient': 1},
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
  'mx': [
    {'element': 'fp8'},
    {'element': 'int4'},
    {'scale_mode': 'even'},
    {'clip_gradient': 'yes'},
  ],
  'nf4': [],
  'none': [],
  'nvfp4': [{'clip_gradient': 0}, {'scale_mode': 'rceil'}],
  'ternary': [
    {'clip_gradient': 1},
    {'clip_gradient': 'yes'},
  ],
}


# Every name runs every check but one of the two engine checks by default
# (tests/contract_cases.py); `-m slow` runs the full cross-product.
@pytest.mark.parametrize(('name', 'check'), cases(numerics.names(), CHECKS))
def test_contract(name, check):
  check(numerics.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(ContractError, match='add an entry'):
    check_bad_fields(numerics.IntSymmetric, None)
  with pytest.raises(ContractError, match='add some'):
    check_bad_fields(numerics.IntSymmetric, [])
  check_bad_fields(numerics.NoNumerics, [])


def test_registry():
  assert {'none', 'int_symmetric', 'fp8', 'fp'} <= set(numerics.names())
  check_registry(numerics, numerics.Numerics, unknown='int9')
