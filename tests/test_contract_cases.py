"""tests/contract_cases.py: which contract pairs run by default."""

import doctest

import pytest

from tests import contract_cases
from tests.contract_cases import cases


def check_builds(cls, bad_fields):
  del cls, bad_fields


def check_engine(cls, bad_fields):
  del cls, bad_fields


def check_ragged(cls, bad_fields):
  del cls, bad_fields


CHECKS = (check_builds, check_engine, check_ragged)


def test_every_name_runs_one_engine_check_by_default_and_all_under_slow():
  params = cases(['c', 'a', 'b'], CHECKS)
  assert len(params) == 9  # the full cross-product
  fast = [p.id for p in params if not p.marks]
  assert fast == [
    'a-builds',
    'a-engine',
    'b-builds',
    'b-ragged',
    'c-builds',
    'c-engine',
  ]
  assert all(m.name == 'slow' for p in params for m in p.marks)


def test_a_heavy_name_without_its_check_is_an_error():
  with pytest.raises(ValueError, match='check_ragged'):
    cases(['a'], (check_builds, check_engine))


def test_docstring_example():
  result = doctest.testmod(contract_cases)
  assert result.attempted > 0 and result.failed == 0
