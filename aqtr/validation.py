"""Shape-dependent checks of a config, before anything is traced.

The config classes validate every field and every combination that does
not depend on shapes when they are built (`aqtr.fiddle.build` names the
failing path). Whether a sub-channel tile divides the contraction depends
on the operands, so `check_shapes` checks it for given shapes, with the
path of the offending tiling (or N:M sparsity). Each pass contracts a
different axis group:

  fwd   lhs . rhs   contracts the contracting axes (K)
  dlhs  g . rhs     contracts the rhs free axes (N)
  drhs  g . lhs     contracts the lhs free axes (M)

Example:
  >>> import aqtr
  >>> cfg = aqtr.fiddle.config('int8')
  >>> cfg.fwd.lhs.tiling = aqtr.fiddle.as_config(
  ...     aqtr.tilings.SubChannel(tile_size=48))
  >>> check_shapes(cfg, (8, 64), (64, 16), (((1,), (0,)), ((), ())))
  Traceback (most recent call last):
  ...
  ValueError: fwd.lhs.tiling: SubChannel.tile_size=48 does not divide the \
contraction size 64; use a divisor of 64. (fwd contracts 64 elements.)
"""

from __future__ import annotations

from collections.abc import Sequence

import fiddle as fdl
import jax

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout, is_ragged, ragged_layout
from aqtr.core.geometry import check_ragged
from aqtr.core.plan import Plan

__all__ = ['check_shapes']

DimensionNumbers = tuple[
  tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]
]


def check_shapes(
  config: DotGeneralConfig | fdl.Buildable,
  lhs_shape: Sequence[int],
  rhs_shape: Sequence[int],
  dimension_numbers: DimensionNumbers,
) -> None:
  """Raises if a tiling or sparsity of `config` does not fit these shapes.

  Args:
    config: a DotGeneralConfig or its Fiddle config (built first).
    lhs_shape: shape of the lhs operand (activations).
    rhs_shape: shape of the rhs operand (weights).
    dimension_numbers: as for `lax.dot_general`, or `aqtr.RAGGED` for
      `aqtr.ragged_dot` (lhs [M, K], rhs [G, K, N]).

  Raises:
    ValueError: naming the tiling's path (`dlhs.lhs.tiling`), the size it
      must divide and the fix; two operands of one pass asking for
      different tiles; or an N:M sparsity (`fwd.rhs.sparsity`) whose
      groups do not divide the contraction; for `aqtr.RAGGED`, what the
      ragged geometry refuses (`core.geometry.check_ragged`).
  """
  from aqtr import fiddle as aqtr_fiddle

  if isinstance(config, fdl.Buildable):
    config = aqtr_fiddle.build(config)
  ragged = is_ragged(dimension_numbers)
  if ragged:
    lay = ragged_layout(lhs_shape, rhs_shape, dimension_numbers)
  else:
    lay = DotLayout.create(lhs_shape, rhs_shape, dimension_numbers)
  sizes = {'fwd': lay.lhs.k, 'dlhs': lay.rhs.f, 'drhs': lay.lhs.f}
  for name, k in sizes.items():
    raw = getattr(config, name)
    sides = ('lhs',) if raw.use_fwd_quant else ('lhs', 'rhs')
    tiles = {}
    for side in sides:
      t = getattr(raw, side)
      if not t.quantized:
        continue
      try:
        tiles[side] = t.tiling.tile(k)
      except ValueError as e:
        raise ValueError(
          f'{name}.{side}.tiling: {e} ({name} contracts {k} elements.)'
        ) from None
    if len(set(tiles.values()) - {None}) > 1:
      raise ValueError(
        f'{name}.lhs.tiling and {name}.rhs.tiling ask for different tiles '
        f'{tiles} of the same contraction ({k} elements); use one tile size.'
      )
  for name in ('fwd', 'dlhs', 'drhs'):  # Transforms: along their pass's.
    t = getattr(config, name).transform
    if t.transforms:
      t.check_size(sizes[name], f'{name}.lhs.transform')
  for side in ('lhs', 'rhs'):  # Sparsity prunes along the fwd contraction.
    try:
      getattr(config.fwd, side).sparsity.check_size(lay.lhs.k)
    except ValueError as e:
      raise ValueError(
        f'fwd.{side}.sparsity: {e} (fwd contracts {lay.lhs.k} elements.)'
      ) from None
  if ragged:
    lhs, rhs = (
      jax.ShapeDtypeStruct(tuple(s), 'float32') for s in (lhs_shape, rhs_shape)
    )
    check_ragged(Plan.create(lhs, rhs, dimension_numbers, config))
