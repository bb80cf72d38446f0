"""One scale for the whole tensor."""

from __future__ import annotations

import dataclasses

from aqtr.tilings.base import ROLES, Tiling, register


@register('per_tensor')
@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensor(Tiling):
  """One scale per tensor: the calibration reduces over every axis.

  The bound is taken over the finite values; the scale is stored per row
  (equal values) so that a row holding NaN/inf gets a NaN scale and only
  the outputs it feeds are NaN (as with `lax.dot_general`).

  Example:
    >>> PerTensor().tile(1024) is None
    True
  """

  shared = frozenset(ROLES)

  def tile(self, k: int) -> int | None:
    return None
