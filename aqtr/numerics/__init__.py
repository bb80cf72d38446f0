"""Registry `numerics`: number formats (int, affine int, small floats, fp8,
MX, NVFP4, ternary, codebooks, none)."""

from aqtr.numerics.base import Numerics, get, names, register, registry
from aqtr.numerics.codebook import Codebook
from aqtr.numerics.fp import Fp
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_asymmetric import IntAsymmetric
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.mx import Mx
from aqtr.numerics.nf4 import Nf4
from aqtr.numerics.none import NoNumerics
from aqtr.numerics.nvfp4 import NvFp4
from aqtr.numerics.ternary import Ternary

__all__ = [
  'Codebook',
  'Fp',
  'Fp8',
  'IntAsymmetric',
  'IntSymmetric',
  'Mx',
  'Nf4',
  'NoNumerics',
  'NvFp4',
  'Numerics',
  'Ternary',
  'get',
  'names',
  'register',
  'registry',
]
