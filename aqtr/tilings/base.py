"""Tilings: which elements of an operand share one scale.

In a dot every operand is seen as the 4-D view [batch, tile, free, k]: the
contraction axes (flattened, in dot order) are split into `tile` blocks of
`k` elements each (one block when not tiled). A tiling names the view axes
its scale is shared along (the calibration reduces over them) and, for
sub-channel tilings, the block size. Scales that are constant along `k`
factor out of the integer dot, so every tiling here runs the real int dot.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

from aqtr.core.registry import Registry

ROLES = ('batch', 'tile', 'free', 'k')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling(abc.ABC):
  """Base class of the `tilings` registry."""

  # The view axes (a subset of ROLES) that share one scale.
  shared: ClassVar[frozenset[str]]

  @abc.abstractmethod
  def tile(self, k: int) -> int | None:
    """Block size along the flattened contraction size `k`; None: untiled.

    Raises:
      ValueError: when the tiling does not fit `k`.
    """

  def free_block(self, f: int) -> int | None:
    """Rows per scale block along the flattened free size `f` (2-D blocks).

    None (the default): the scale is not shared across rows (unless 'free'
    is in `shared`).
    """
    del f
    return None


registry: Registry = Registry('tilings', Tiling)
register = registry.register
get = registry.get
names = registry.names
