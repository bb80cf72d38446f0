"""Registry `transforms`: orthogonal maps along a dot's contraction.

  none      the identity (the default);
  hadamard  blocked (random) Hadamard transform, 16/32/128 wide.

A transform is applied to both operands of a dot along the contraction
before quantization; exact arithmetic leaves the product unchanged
(`(x R)(R^T w) = x w`). See `aqtr.transforms.Transform`.
"""

from aqtr.transforms.base import Transform, get, names, register, registry
from aqtr.transforms.hadamard import Hadamard, hadamard_matrix
from aqtr.transforms.none import NoTransform

__all__ = [
  'Hadamard',
  'NoTransform',
  'Transform',
  'get',
  'hadamard_matrix',
  'names',
  'register',
  'registry',
]
