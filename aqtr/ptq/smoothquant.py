"""SmoothQuant: move activation outliers into the weights, then W8A8.

Xiao et al. 2022, arXiv 2211.10438. For the weight ops reading one input
X (a fold group), per input channel j

  s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

with the maxima over the calibration tokens and over the rows j of every
consumer weight. `fold.apply` then divides the producer (a norm's scale,
a previous linear's columns) by s and multiplies the consumers' rows by s:
`(X / s) (diag(s) W) = X W`, so the float model is unchanged while X's
outlier channels shrink (alpha = 0.5 splits the range evenly). The
smoothed model then runs W8A8 by rules: `w8a8()` is int8 weights per
output channel and int8 activations per tensor (or per token), real
int8 x int8 dots.

Example:
  >>> import jax.numpy as jnp
  >>> from aqtr.ptq import fold, stats
  >>> x = jnp.array([[8.0, 1.0], [-2.0, 0.5]])
  >>> p = {'n': {'scale': jnp.ones(2)}, 'w': {'kernel': jnp.ones((2, 3))}}
  >>> m = fold.FoldMap(groups=(fold.FoldGroup(name='n',
  ...   sources=(fold.Axis(path='n/scale'),),
  ...   consumers=(fold.Axis(path='w/kernel'),)),))
  >>> st = {'w/kernel': stats.LayerStats.from_activations(x)}
  >>> q, st2, info = smooth(p, m, st, alpha=0.5)
  >>> q['n']['scale'].tolist(), st2['w/kernel'].absmax.tolist()
  ([0.3535533845424652, 1.0], [2.8284270763397217, 1.0])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from aqtr import presets
from aqtr.core.config import DotGeneralConfig
from aqtr.ptq import fold, methods, rewrite
from aqtr.ptq.grid import Grid
from aqtr.ptq.stats import LayerStats, as_matrix
from aqtr.tilings.per_tensor import PerTensor

__all__ = ['ACTIVATIONS', 'SmoothQuant', 'group_scales', 'smooth', 'w8a8']

ACTIVATIONS = ('tensor', 'token')


def _row_absmax(w: jax.Array, axis: int) -> jax.Array:
  return jnp.max(jnp.abs(as_matrix(w, (axis,))).astype(jnp.float32), axis=1)


def group_scales(
  params: Mapping,
  group: fold.FoldGroup,
  stats: Mapping[str, LayerStats],
  alpha: float = 0.5,
) -> jax.Array:
  """SmoothQuant's s [channels] of one fold group (arXiv 2211.10438, eq. 4).

  `s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`, maxima over the group's
  consumers (their stats' absmax: they share X; their rows). A channel
  with no activation or no weight gets s_j = 1.
  """
  xmax = wmax = None
  for ax in group.consumers:
    w = fold.get(params, ax.path)
    r = fold.reduce(_row_absmax(w, ax.axis % w.ndim), ax, 'max')
    wmax = r if wmax is None else jnp.maximum(wmax, r)
    if ax.path in stats:  # The consumers share X: any one's stats do.
      x = fold.reduce(stats[ax.path].absmax, ax, 'max')
      xmax = x if xmax is None else jnp.maximum(xmax, x)
  if xmax is None:
    raise KeyError(
      f'fold group {group.name!r}: no calibration stats for any of its '
      f'consumers ({", ".join(a.path for a in group.consumers)}).'
    )
  ok = (xmax > 0) & (wmax > 0)
  xs, ws = jnp.where(ok, xmax, 1.0), jnp.where(ok, wmax, 1.0)
  s = xs**alpha / ws ** (1.0 - alpha)
  return jnp.where(ok, jnp.maximum(s, 1e-5), 1.0)


def smooth(
  params: Mapping,
  fold_map: fold.FoldMap,
  stats: Mapping[str, LayerStats],
  alpha: float = 0.5,
) -> tuple[dict, dict[str, LayerStats], dict[str, dict[str, float]]]:
  """Smooths every group of `fold_map`; the float model is unchanged.

  Args:
    params: the float parameters (nested dict).
    fold_map: the model's fold groups (`fold.detect` for the known LMs).
    stats: calibration stats keyed by each consumer weight's path.
    alpha: migration strength in [0, 1].

  Returns:
    (smoothed params, the stats of the consumers' smoothed inputs, per
    group {'alpha', 'act_max_before', 'act_max_after', 's_min', 's_max'});
    a group none of whose consumers has stats is left as is.
  """
  _check_alpha('smooth', alpha)
  fold.check(params, fold_map)
  out, new_stats, info = dict(params), dict(stats), {}
  for g in fold_map.groups:
    if not any(a.path in stats for a in g.consumers):
      continue  # No consumer calibrated (left float by the rules).
    s = group_scales(out, g, stats, alpha)
    out = fold.apply(out, g, s)
    before = after = 0.0
    for ax in g.consumers:
      if ax.path not in stats:
        continue
      st = stats[ax.path]
      new_stats[ax.path] = fold.scale_stats(st, fold.expand(s, ax))
      before = max(before, float(jnp.max(st.absmax)))
      after = max(after, float(jnp.max(new_stats[ax.path].absmax)))
    info[g.name] = {
      'alpha': float(alpha),
      'act_max_before': before,
      'act_max_after': after,
      's_min': float(jnp.min(s)),
      's_max': float(jnp.max(s)),
    }
  return out, new_stats, info


def _check_alpha(who: str, alpha: Any) -> None:
  ok = isinstance(alpha, int | float) and not isinstance(alpha, bool)
  if not ok or not math.isfinite(alpha) or not 0.0 <= alpha <= 1.0:
    raise ValueError(f'{who}: alpha must be a number in [0, 1], got {alpha!r}.')


def w8a8(activations: str = 'tensor') -> DotGeneralConfig:
  """int8 x int8 forward: weights per output channel, activations per
  `activations` ('tensor': one dynamic absmax scale per tensor; 'token':
  one per row); gradients float (post-training use).

  Example:
    >>> type(w8a8().fwd.lhs.tiling).__name__
    'PerTensor'
  """
  if activations not in ACTIVATIONS:
    raise ValueError(
      f'smoothquant.w8a8: activations must be one of {ACTIVATIONS}, got '
      f'{activations!r}.'
    )
  cfg = presets.int8_fwd()
  if activations == 'token':
    return cfg
  lhs = dataclasses.replace(cfg.fwd.lhs, tiling=PerTensor())
  return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, lhs=lhs))


@methods.register('smoothquant')
@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuant(methods.Method):
  """SmoothQuant (arXiv 2211.10438): smooth, then the rules' W8A8.

  As an `aqtr.ptq.quantize` method: `rewrite` smooths the float model
  (`smooth`), then each weight is rounded to nearest on its rule's grid;
  the served model quantizes activations as its rules say (`w8a8()`).

  Attributes:
    alpha: migration strength in [0, 1] (0.5 in the paper).
    fold_map: the model's fold map; None: `fold.detect` from the
      parameters.

  Example:
    >>> SmoothQuant(alpha=0.8).alpha
    0.8
  """

  alpha: float = 0.5
  fold_map: fold.FoldMap | None = None

  def __post_init__(self):
    _check_alpha('SmoothQuant.alpha', self.alpha)
    fold.check_field('SmoothQuant.fold_map', self.fold_map)

  def rewrite(self, target, collected):
    """Smooths the target's parameters (the float model is unchanged)."""

    def fn(params, stats, configs, contracting):
      del configs
      fm = rewrite.fold_map_of(self.fold_map, target, params)
      fold.check_inputs(params, fm, contracting)
      new, new_stats, _ = smooth(params, fm, stats, self.alpha)
      return new, new_stats

    return rewrite.apply(target, collected, fn)

  def solve(self, site, grid: Grid, stats: LayerStats):
    """Round to nearest of the rewritten weight on its grid (`Rtn`)."""
    return methods.Rtn().solve(site, grid, stats)
