"""Registry `tilings`: which elements share a scale."""

from aqtr.tilings.base import ROLES, Tiling, get, names, register, registry
from aqtr.tilings.block2d import Block2d
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor
from aqtr.tilings.subchannel import SubChannel

__all__ = [
  'ROLES',
  'Block2d',
  'PerChannel',
  'PerTensor',
  'SubChannel',
  'Tiling',
  'get',
  'names',
  'register',
  'registry',
]
