"""The `method` registry of `aqtr.ptq.quantize`: how each weight is solved.

A method is a frozen kw-only dataclass with two steps:

  rewrite(target, collected) -> (target, collected)
      float rewrites before quantizing (AWQ / SmoothQuant scale and fold
      weights; default: none);
  solve(site, grid, stats) -> gptq.Solution
      the weight's q-values (and dequantized values) on its grid
      (`aqtr.ptq.grid.Grid`; `Solution.scale` / `zero`: the grid, the
      given one unless the method refreshes it).

so a rewriting method can end with RTN's or GPTQ's `solve` (compose by
holding a `then` method). Register a new one with `@register('name')`.

A rewrite keeps the model and its statistics consistent: it returns a
target (the model's host, `aqtr.flax.hosts.of`) whose float parameters hold
the rewritten weights (convert freezes those) and a `Collected` whose
`weights` are the same weights as matrices' sources and whose `stats`
describe the rewritten inputs (e.g. inputs scaled by 1/s per channel:
`xtx' = diag(1/s) xtx diag(1/s)`, `absmax' = absmax / s`).

Example:
  >>> get('gptq')
  Gptq(block_size=128, percdamp=0.01, act_order=False, static_groups=True)
  >>> get(Rtn())
  Rtn()
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from aqtr.ptq import gptq
from aqtr.ptq.grid import Grid, check_config
from aqtr.ptq.stats import LayerStats

_METHODS: dict[str, type] = {}


def register(name: str):
  """Class decorator: `aqtr.ptq.quantize(..., method=name)` builds it."""

  def deco(cls):
    if name in _METHODS:
      raise ValueError(f'aqtr.ptq: method {name!r} is already registered.')
    cls.name = name
    _METHODS[name] = cls
    return cls

  return deco


def names() -> list[str]:
  """The registered method names."""
  return sorted(_METHODS)


def get(method, **options) -> Method:
  """A method instance from a name (with `options`) or an instance."""
  if isinstance(method, Method):
    if options:
      raise TypeError(
        f'aqtr.ptq: options {sorted(options)} given with a method instance; '
        'set them on the instance.'
      )
    return method
  if method not in _METHODS:
    raise ValueError(
      f'aqtr.ptq: method must be one of {names()} or a Method, got {method!r}.'
    )
  cls = _METHODS[method]
  fields = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(options) - set(fields))
  if unknown:
    raise TypeError(
      f'aqtr.ptq: method {method!r} has no option(s) {unknown}; its options '
      f'are {fields}.'
    )
  return cls(**options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
  """Base of the registry (see the module docstring)."""

  name: ClassVar[str] = ''

  def rewrite(self, target, collected):
    """Float rewrites of the model and its stats (none by default)."""
    return target, collected

  def check(self, site) -> None:
    """Raises one line when the method cannot solve `site`'s config."""
    check_config(site.config, site.op_path, type(self).__name__)

  def solve(self, site, grid: Grid, stats: LayerStats) -> gptq.Solution:
    """The weight's solution on `grid`."""
    raise NotImplementedError


def check_data(path: str, stats: LayerStats, method: str) -> None:
  """One line when the op's calibration inputs are all zero (or none).

  A data-driven solver would then zero every weight (GPTQ zeroes dead
  inputs' rows) and report no error.
  """
  if not bool((stats.xtx != 0).any()):
    raise ValueError(
      f'aqtr.ptq: {path}: every calibration input to this op is zero '
      f'({int(stats.count)} tokens), so {method} has no data to solve '
      "with; give calibration batches that reach it, or method='rtn'."
    )


@register('rtn')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Rtn(Method):
  """Round to nearest: exactly what `aqtr.flax.convert` stores."""

  def solve(self, site, grid: Grid, stats: LayerStats) -> gptq.Solution:
    del site, stats
    q, wq = grid.quantize(grid.w2)
    return gptq.Solution(q, wq, grid.scale2, grid.zero2)


@register('gptq')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Gptq(Method):
  """GPTQ (arXiv 2210.17323) on the rule's grid (`aqtr.ptq.gptq`).

  Attributes:
    block_size: rows per lazy block, >= 1 (the paper's 128).
    percdamp: dampening as a fraction of mean(diag H), finite and >= 0.
    act_order: process inputs by decreasing H_ii (un-permuted after).
    static_groups: True: every group keeps RTN's scales (from the
      original weight; any numerics and tiling). False: a sub-channel
      group's scales come from its error-updated rows when GPTQ reaches
      it (the paper's groups; not with act_order nor NVFP4, whose tensor
      scale spans every block).
  """

  block_size: int = 128
  percdamp: float = 0.01
  act_order: bool = False
  static_groups: bool = True

  def __post_init__(self):
    b = self.block_size
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
      raise ValueError(f'Gptq.block_size must be an int >= 1, got {b!r}.')
    p = self.percdamp
    if isinstance(p, bool) or not isinstance(p, int | float):
      raise TypeError(f'Gptq.percdamp must be a float, got {p!r}.')
    if not (math.isfinite(p) and p >= 0):
      raise ValueError(f'Gptq.percdamp must be finite and >= 0, got {p}.')
    for name in ('act_order', 'static_groups'):
      v = getattr(self, name)
      if not isinstance(v, bool):
        raise TypeError(f'Gptq.{name} must be True or False, got {v!r}.')

  def solve(self, site, grid: Grid, stats: LayerStats) -> gptq.Solution:
    check_data(site.op_path, stats, 'GPTQ')
    try:
      group, regroup = (0, None) if self.static_groups else grid.regroup()
      return gptq.solve(
        grid.w2,
        stats.hessian,
        grid.scale2,
        grid.zero2,
        grid.numerics,
        block_size=self.block_size,
        act_order=self.act_order,
        percdamp=self.percdamp,
        group=group,
        regroup=regroup,
      )
    except ValueError as e:
      raise ValueError(f'aqtr.ptq: GPTQ of {site.op_path}: {e}') from None


__all__ = [
  'Gptq',
  'Method',
  'Rtn',
  'check_data',
  'get',
  'names',
  'register',
]
