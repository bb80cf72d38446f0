"""Registry `numerics`: number formats (int, small floats, fp8, none)."""

from aqtr.numerics.base import Numerics, get, names, register, registry
from aqtr.numerics.fp import Fp
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.none import NoNumerics

__all__ = [
  'Fp',
  'Fp8',
  'IntSymmetric',
  'NoNumerics',
  'Numerics',
  'get',
  'names',
  'register',
  'registry',
]
