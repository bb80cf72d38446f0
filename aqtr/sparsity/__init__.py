"""Registry `sparsity`: which elements of an operand are kept (pruning).

  none       every element (the default);
  n_m        N:M structured: n of every m along the contraction;
  magnitude  unstructured: the largest `keep` fraction.

The engine applies an operand's sparsity before quantizing it, in every
pass the operand appears in; see `aqtr.core.algorithms.Sparsity`.
"""

from aqtr.sparsity.base import (
  Sparsity,
  configure,
  get,
  names,
  register,
  registry,
)
from aqtr.sparsity.magnitude import Magnitude
from aqtr.sparsity.n_m import NM
from aqtr.sparsity.none import NoSparsity

__all__ = [
  'NM',
  'Magnitude',
  'NoSparsity',
  'Sparsity',
  'configure',
  'get',
  'names',
  'register',
  'registry',
]
