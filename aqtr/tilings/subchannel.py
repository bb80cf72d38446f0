"""Sub-channel tiling: one scale per block of the contraction axes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from aqtr.tilings.base import Tiling, register


@register('subchannel')
@dataclasses.dataclass(frozen=True, kw_only=True)
class SubChannel(Tiling):
  """Splits the contraction axes into blocks with a scale each.

  Math: the flattened contraction axis K (the contraction axes in dot order,
  row-major) is split into K/t tiles of t elements. The tile index becomes a
  batch axis of the integer dot, each partial product is rescaled by its
  tiles' scales and the partials are summed in f32:
    out = sum_j (q_L[.., j, :] . q_R[.., j, :]) * s_L[j] * s_R[j]^T.
  With one contraction axis this is tiling that axis. Give at most one of
  `tile_size` and `tile_count` (the other 0); with neither, tiles hold
  `DEFAULT_TILE_SIZE` (128) elements. The partner operand of a tiled
  operand is split with the same tiles (its scale may still be shared
  across them).

  Attributes:
    tile_size: elements per tile, > 0, dividing K; or 0.
    tile_count: tiles per contraction, > 0, dividing K; or 0.

  Example:
    >>> SubChannel(tile_size=128).tile(1024)
    128
    >>> SubChannel(tile_count=4).tile(1024)
    256
  """

  tile_size: int = 0
  tile_count: int = 0

  shared = frozenset({'k'})
  DEFAULT_TILE_SIZE: ClassVar[int] = 128

  def __post_init__(self):
    for name in ('tile_size', 'tile_count'):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f'SubChannel.{name} must be an int >= 0, got {v!r}.')
    if self.tile_size > 0 and self.tile_count > 0:
      raise ValueError(
        'SubChannel takes at most one of tile_size and tile_count > 0, got '
        f'tile_size={self.tile_size}, tile_count={self.tile_count}.'
      )

  def tile(self, k: int) -> int | None:
    count = self.tile_count
    size = self.tile_size or (0 if count else self.DEFAULT_TILE_SIZE)
    if size:
      if k % size:
        raise ValueError(
          f'SubChannel.tile_size={size} does not divide the contraction '
          f'size {k}; use a divisor of {k}.'
        )
      return size
    if k % count:
      raise ValueError(
        f'SubChannel.tile_count={count} does not divide the contraction '
        f'size {k}; use a divisor of {k}.'
      )
    return k // count
