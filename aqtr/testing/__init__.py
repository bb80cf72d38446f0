"""Contract checks for your own registered algorithms.

Every registry (`calibrations`, `numerics`, `tilings`, `sparsity`,
`freezers`, `transforms`) has a
contract: what any class registered in it must do for the engine and the
adapters to work with it. aqtr's own tests run these checks on every
registered name; call them on yours:

  from aqtr.testing import check_calibration
  check_calibration(MyCalibration, [{'c': 0.0}])   # bad-field examples

Each `check_*` raises `ContractError` (an AssertionError) naming what is
wrong. The single checks are in `aqtr.testing.<family>.CHECKS`, e.g. to
parametrize a pytest test. Not imported by `import aqtr` (it imports fiddle
and numpy testing helpers); no pytest needed.

Example (one check; `check_tiling(tilings.PerTensor, [])` runs them all):
  >>> from aqtr import tilings
  >>> from aqtr.testing import tilings as contract
  >>> contract.check_builds(tilings.PerTensor, [])
  >>> contract.check_bad_fields(tilings.SubChannel, [{'tile_size': -1}])
"""

from aqtr.testing.calibrations import check_calibration
from aqtr.testing.checks import ContractError, check_registry
from aqtr.testing.freezers import check_freezer
from aqtr.testing.numerics import check_numerics
from aqtr.testing.sparsity import check_sparsity
from aqtr.testing.tilings import check_tiling
from aqtr.testing.transforms import check_transform

__all__ = [
  'ContractError',
  'check_calibration',
  'check_freezer',
  'check_numerics',
  'check_registry',
  'check_sparsity',
  'check_tiling',
  'check_transform',
]
