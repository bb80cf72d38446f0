"""One scale per channel: shared along the contraction axes only."""

from __future__ import annotations

import dataclasses

from aqtr.tilings.base import Tiling, register


@register('per_channel')
@dataclasses.dataclass(frozen=True, kw_only=True)
class PerChannel(Tiling):
  """One scale per row of the lhs / column of the rhs (the default).

  Math: the scale of operand X is `bound(X)` reduced over its contraction
  axes, so it varies along batch and free axes and factors out of the dot:
  `out = (q_L . q_R) * s_L * s_R^T`.

  Example:
    >>> PerChannel().tile(1024) is None
    True
  """

  shared = frozenset({'tile', 'k'})

  def tile(self, k: int) -> int | None:
    return None
