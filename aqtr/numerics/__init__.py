"""Registry `numerics`: number formats (int symmetric, fp8, ternary, ...)."""

from aqtr.numerics.base import Numerics, get, names, register, registry
from aqtr.numerics.codebook import Codebook
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.nf4 import Nf4
from aqtr.numerics.none import NoNumerics
from aqtr.numerics.ternary import Ternary

__all__ = [
  'Codebook',
  'Fp8',
  'IntSymmetric',
  'Nf4',
  'NoNumerics',
  'Numerics',
  'Ternary',
  'get',
  'names',
  'register',
  'registry',
]
