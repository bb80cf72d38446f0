"""aqtr.testing: importable without pytest, and its checks can fail."""

import dataclasses
import subprocess
import sys

import pytest

from aqtr import calibrations, tilings
from aqtr.testing import ContractError, checks
from aqtr.testing import calibrations as calibration_contract
from aqtr.testing import tilings as tiling_contract


def test_import_aqtr_does_not_import_the_harness_and_it_needs_no_pytest():
  code = (
    'import sys, aqtr; before = "aqtr.testing" in sys.modules; '
    'import aqtr.testing; print(before, "pytest" in sys.modules)'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  assert out.stdout.split() == ['False', 'False']


def test_a_field_without_validation_breaks_the_contract():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Lax(calibrations.AbsMax):
    margin: float = 1.0  # never validated

  with pytest.raises(ContractError, match='expected one of'):
    checks.check_bad_fields(
      Lax, [{'margin': -1.0}], family='calibrations', base=calibrations.AbsMax
    )
  with pytest.raises(ContractError, match='no bad-field examples'):
    calibration_contract.check_bad_fields(Lax, None)


def test_an_identity_compared_class_breaks_the_contract():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class ById(tilings.PerTensor):
    __hash__ = object.__hash__

    def __eq__(self, other):
      return self is other

  tiling_contract.check_builds(tilings.PerTensor, [])
  with pytest.raises(AssertionError):
    tiling_contract.check_builds(ById, [])
