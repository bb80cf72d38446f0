"""2-D block tiling: one scale per (free rows x contraction) block."""

from __future__ import annotations

import dataclasses

from aqtr.tilings.base import Tiling, register


@register('block2d')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Block2d(Tiling):
  """Square-ish weight blocks sharing one scale, the same under transpose.

  Math (DeepSeek-AI 2024, DeepSeek-V3, arXiv 2412.19437: 128x128 weight
  blocks; NVIDIA NVFP4 training, arXiv 2509.25149: 16x16 weight blocks).
  The contraction K is split into tiles of `tile_size` (as `subchannel`:
  the tile index becomes a batch axis of the dot) and the free axis into
  blocks of `free_size` rows; every `free_size x tile_size` block shares
  one scale. Because a block is a block whichever of its two axes is
  contracted, the weight quantized for the forward dot (contracting K) and
  for the input-gradient dot (contracting N) are the same tensor when both
  use Block2d(tile_size=a, free_size=a): forward and backward see the same
  quantized weight. The stored scale has one entry per row (repeated over
  the rows of a block) so it factors out of each tile's dot. A last,
  partial block of rows (free size not a multiple of `free_size`) is
  calibrated as if padded by repeating its last row.

  Attributes:
    tile_size: elements per block along the contraction, > 0, dividing K.
    free_size: rows per block along the free axes, > 0.

  Example:
    >>> Block2d(tile_size=128, free_size=128).tile(1024)
    128
  """

  tile_size: int = 128
  free_size: int = 128

  shared = frozenset({'k'})

  def __post_init__(self):
    for name in ('tile_size', 'free_size'):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f'Block2d.{name} must be an int > 0, got {v!r}.')

  def tile(self, k: int) -> int | None:
    if k % self.tile_size:
      raise ValueError(
        f'Block2d.tile_size={self.tile_size} does not divide the '
        f'contraction size {k}; use a divisor of {k}.'
      )
    return self.tile_size

  def free_block(self, f: int) -> int | None:
    return self.free_size
