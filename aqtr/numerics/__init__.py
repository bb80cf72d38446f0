"""Registry `numerics`: number formats (int, small floats, fp8, none)."""

from aqtr.numerics.base import Numerics, get, names, register, registry
from aqtr.numerics.fp import Fp
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_asymmetric import IntAsymmetric
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.mx import Mx
from aqtr.numerics.none import NoNumerics
from aqtr.numerics.nvfp4 import NvFp4

__all__ = [
  'Fp',
  'Fp8',
  'IntAsymmetric',
  'IntSymmetric',
  'Mx',
  'NoNumerics',
  'NvFp4',
  'Numerics',
  'get',
  'names',
  'register',
  'registry',
]
