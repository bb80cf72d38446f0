"""AWQ: activation-aware per-input-channel weight scaling and clipping.

Lin et al. 2023, arXiv 2306.00978. The weight rows that meet large
activations matter most; scaling them up before quantization (and the
input down, folded into the producer: `fold`) shrinks their relative
rounding error. For a fold group with consumers W_c reading X:

  s(alpha) = m^alpha / sqrt(max(m^alpha) min(m^alpha)),  m_j = mean|X_j|
  err(alpha) = sum_c tr(dW_c^T xtx_c dW_c),
  dW_c = diag(1/s) Q(diag(s) W_c) - W_c

with Q the rule's weight quantizer (`aqtr.quantize` with the op's
`fwd.rhs` config: any registered numerics and tiling) and
`tr(dW^T xtx dW) = ||X dW||^2` over the calibration tokens. alpha runs
over a grid (20 points in [0, 1)); a group keeps s = 1 (round to
nearest) unless some alpha beats it, so the result is never worse than
RTN on the calibration data. `duo=True` searches AutoAWQ's duo scaling
`s = m^alpha / w^(1 - alpha)` instead (w: mean |W| relative to its
scale group's max, per input channel). Then,
per consumer, the clip search: for each output channel and scale group
(the tiling's tile along the input, or the whole input) a shrink ratio
r on `1 - i / clip_grid`, i < max_shrink * clip_grid, clips the weight
to +-r max|W_group| where `||X_group dW_group||^2` is least. The clipped
float weight is written back, so the rule's own quantizer (absmax
calibration) gives the searched values when the model is converted.

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> from aqtr.ptq import fold, stats
  >>> x = jax.random.normal(jax.random.key(0), (64, 8)) * jnp.arange(1, 9)[None]
  >>> p = {'n': {'scale': jnp.ones(8)},
  ...      'w': {'kernel': jax.random.normal(jax.random.key(1), (8, 4))}}
  >>> m = fold.FoldMap(groups=(fold.FoldGroup(name='n',
  ...   sources=(fold.Axis(path='n/scale'),),
  ...   consumers=(fold.Axis(path='w/kernel'),)),))
  >>> st = {'w/kernel': stats.LayerStats.from_activations(x)}
  >>> cfg = {'w/kernel': aqtr.presets.int4_weight_only().fwd.rhs}
  >>> q, _, info = solve(p, m, st, cfg)
  >>> info['n']['error'] <= info['n']['rtn_error']
  True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.core.config import TensorConfig
from aqtr.core.quantizer import quantize
from aqtr.ptq import fold, methods, rewrite
from aqtr.ptq.grid import Grid
from aqtr.ptq.stats import LayerStats, as_matrix, from_matrix, output_error

__all__ = ['Awq', 'clip_search', 'rtn', 'scale_errors', 'scales', 'solve']


def _grid(n: int) -> tuple[float, ...]:
  return tuple(i / n for i in range(n))


@methods.register('awq')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Awq(methods.Method):
  """AWQ (arXiv 2306.00978): scale search, then optional clip search.

  As an `aqtr.ptq.quantize` method: `rewrite` folds the scales and clips
  the weights (`solve` below), then each weight is rounded to nearest on
  its rule's grid.

  Attributes:
    alphas: the exponents searched, each in [0, 1] (default 20 points in
      [0, 1); include 0 to never do worse than RTN).
    duo: duo scaling (AutoAWQ's): s = mean|X|^alpha / w^(1 - alpha), w the
      mean over outputs of |W| relative to its scale group's max.
    clip: run the weight-clip search after the scales.
    clip_grid: shrink steps: ratios 1 - i / clip_grid.
    max_shrink: the largest shrink, in [0, 1): i < max_shrink * clip_grid.
    fold_map: the model's fold map; None: `fold.detect` from the
      parameters.

  Example:
    >>> Awq(alphas=(0.0, 0.5), clip=False).alphas
    (0.0, 0.5)
  """

  alphas: tuple[float, ...] = _grid(20)
  duo: bool = False
  clip: bool = True
  clip_grid: int = 20
  max_shrink: float = 0.5
  fold_map: fold.FoldMap | None = None

  def __post_init__(self):
    a = self.alphas
    if not isinstance(a, tuple) or not a:
      raise ValueError(
        f'Awq.alphas must be a non-empty tuple of numbers in [0, 1], got {a!r}.'
      )
    for v in a:
      num = isinstance(v, int | float) and not isinstance(v, bool)
      if not num or not math.isfinite(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f'Awq.alphas: {v!r} is not a number in [0, 1].')
    for name in ('duo', 'clip'):
      v = getattr(self, name)
      if not isinstance(v, bool):
        raise TypeError(f'Awq.{name} must be a bool, got {v!r}.')
    g = self.clip_grid
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
      raise ValueError(f'Awq.clip_grid must be an int >= 1, got {g!r}.')
    m = self.max_shrink
    if (
      not isinstance(m, int | float)
      or isinstance(m, bool)
      or not (0.0 <= m < 1.0)
    ):
      raise ValueError(f'Awq.max_shrink must be in [0, 1), got {m!r}.')
    fold.check_field('Awq.fold_map', self.fold_map)

  def rewrite(self, target, collected):
    """Scales, folds and clips the target's weights (float rewrite)."""

    def fn(params, stats, configs, contracting):
      fm = rewrite.fold_map_of(self.fold_map, target, params)
      fold.check_inputs(params, fm, contracting)
      new, new_stats, _ = solve(params, fm, stats, configs, self)
      return new, new_stats

    return rewrite.apply(target, collected, fn)

  def solve(self, site, grid: Grid, stats: LayerStats):
    """Round to nearest of the rewritten weight on its grid (`Rtn`)."""
    return methods.Rtn().solve(site, grid, stats)

  @property
  def ratios(self) -> tuple[float, ...]:
    """The clip shrink ratios searched (1.0 first: no clip)."""
    n = max(1, int(self.max_shrink * self.clip_grid))
    return tuple(1.0 - i / self.clip_grid for i in range(n))


def rtn(w: jax.Array, cfg: TensorConfig, axis: int) -> jax.Array:
  """Round-to-nearest of weight `w` contracting `axis`, dequantized (f32)."""
  w = w.astype(jnp.float32)
  return quantize(w, cfg, contracting_axes=(axis,)).dequant(jnp.float32)


def scales(
  mean_abs: jax.Array, alpha: jax.Array, w_mean: jax.Array | None = None
) -> jax.Array:
  """AWQ's s = m^alpha / sqrt(max * min) (m = mean|X|, floored at 1e-4).

  With `w_mean` (duo scaling): s = m^alpha / (w_mean^(1 - alpha) + 1e-4)
  before the normalisation.
  """
  s = mean_abs.astype(jnp.float32) ** alpha
  if w_mean is not None:
    s = s / (w_mean.astype(jnp.float32) ** (1.0 - alpha) + 1e-4)
  s = jnp.maximum(s, 1e-4)
  return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


def weight_mean(w: jax.Array, cfg: TensorConfig, ax: fold.Axis) -> jax.Array:
  """[channels] mean over outputs of |W| / max|W| of its scale group."""
  axis = ax.axis % w.ndim
  w2 = jnp.abs(as_matrix(w, (axis,)).astype(jnp.float32))
  d_in, d_out = w2.shape
  group = _group_size(cfg, d_in) or d_in
  w3 = w2.reshape(d_in // group, group, d_out)
  top = jnp.max(w3, axis=1, keepdims=True)
  rel = (w3 / jnp.where(top > 0, top, 1.0)).reshape(d_in, d_out)
  return fold.reduce(jnp.mean(rel, axis=1), ax, 'mean')


def _scaled_error(w, xtx, s, cfg, ax: fold.Axis):
  axis = ax.axis % w.ndim
  f = fold.along(fold.expand(s, ax), w.ndim, axis)
  q = rtn(w * f, cfg, axis) / f
  return output_error(as_matrix(q - w, (axis,)), xtx)


@functools.partial(jax.jit, static_argnames=('cfgs', 'axes'))
def scale_errors(ws, xtxs, mean_abs, alphas, w_mean=None, *, cfgs, axes):
  """err(alpha) [len(alphas)] of one group's consumers (see module doc).

  Args:
    ws: the consumers' weights (tuple).
    xtxs: their stats' xtx (tuple).
    mean_abs: [channels] the group's mean|X| (reduced over repeats).
    alphas: [A] exponents.
    w_mean: None, or [channels] `weight_mean` (duo scaling).
    cfgs: the consumers' weight TensorConfigs (static).
    axes: the consumers' `fold.Axis` (static).
  """

  def one(alpha):
    s = scales(mean_abs, alpha, w_mean)
    errs = [
      _scaled_error(w, x, s, c, a)
      for w, x, c, a in zip(ws, xtxs, cfgs, axes, strict=True)
    ]
    return sum(errs[1:], errs[0])

  return jax.lax.map(one, alphas)


def _group_size(cfg: TensorConfig, d_in: int) -> int | None:
  """Input rows per scale (None: a scale spans output channels)."""
  t = cfg.tiling
  if 'free' in t.shared or t.free_block(1) is not None:
    return None
  return t.tile(d_in) or d_in


@functools.partial(jax.jit, static_argnames=('cfg', 'axis', 'group'))
def clip_search(w, xtx, ratios, *, cfg, axis, group):
  """Clips `w` per (scale group, output) at the ratio of least error.

  Returns:
    (clipped w, block error without clip, block error with the clip), the
    errors summed over the diagonal blocks of `xtx` (each scale group's
    own inputs, as the reference computes per group).
  """
  w2 = as_matrix(w, (axis,)).astype(jnp.float32)
  d_in, d_out = w2.shape
  n = d_in // group
  w3 = w2.reshape(n, group, d_out)
  top = jnp.max(jnp.abs(w3), axis=1, keepdims=True)
  x4 = xtx.reshape(n, group, n, group)
  idx = jnp.arange(n)
  blocks = x4[idx, :, idx, :]

  def clipped(r):
    c = jnp.clip(w3, -r * top, r * top).reshape(d_in, d_out)
    return from_matrix(c, (axis,), w.shape)

  def err(r):
    q = as_matrix(rtn(clipped(r), cfg, axis), (axis,))
    d = (q - w2).reshape(n, group, d_out)
    hp = jax.lax.Precision.HIGHEST
    return jnp.einsum('gio,gij,gjo->go', d, blocks, d, precision=hp)

  errs = jax.lax.map(err, ratios)
  best = ratios[jnp.argmin(errs, axis=0)][:, None, :]
  return clipped(best), jnp.sum(errs[0]), jnp.sum(jnp.min(errs, axis=0))


def _usable(path: str, cfg: Any) -> TensorConfig | None:
  if cfg is None:
    return None
  if not isinstance(cfg, TensorConfig):
    raise TypeError(
      f'awq: the config of {path!r} must be a TensorConfig (the rule '
      f"config's fwd.rhs) or None, got {type(cfg).__name__}."
    )
  if not cfg.quantized:
    return None
  if cfg.rounding.stochastic:
    raise ValueError(
      f'awq: {path!r} rounds its weight stochastically; AWQ needs a '
      'deterministic weight quantizer (use NearestEven rounding).'
    )
  return cfg


def _stats(stats: Mapping[str, LayerStats], who: str, path: str):
  if path not in stats:
    raise KeyError(
      f'awq: no calibration stats for {who} {path!r} (stats hold '
      f'{len(stats)} ops, e.g. {", ".join(sorted(stats)[:3])}).'
    )
  return stats[path]


def _rtn_error(w, xtx, cfg, axis: int, path: str) -> float:
  try:
    q = rtn(w, cfg, axis)
  except (ValueError, TypeError) as e:
    raise type(e)(f'aqtr.ptq: awq: {path}: {e}') from None
  return float(output_error(as_matrix(q - w, (axis,)), xtx))


def _finish(out, paths, before, stats, cfgs, method):
  """Clip search on `paths` (optional); returns (params, error after)."""
  err = 0.0
  for ax in paths:
    cfg, st = cfgs[ax.path], stats[ax.path]
    w = fold.get(out, ax.path)
    axis = ax.axis % w.ndim
    group = _group_size(cfg, w.shape[axis])
    if method.clip and group is not None:
      ratios = jnp.asarray(method.ratios, jnp.float32)
      w, _, _ = clip_search(w, st.xtx, ratios, cfg=cfg, axis=axis, group=group)
      out = fold.replace(out, ax.path, w.astype(fold.get(out, ax.path).dtype))
    q = rtn(fold.get(out, ax.path), cfg, axis)
    ref = before[ax.path].astype(jnp.float32)
    err += float(output_error(as_matrix(q - ref, (axis,)), st.xtx))
  return out, err


def solve(
  params: Mapping,
  fold_map: fold.FoldMap,
  stats: Mapping[str, LayerStats],
  configs: Mapping[str, TensorConfig | None],
  method: Awq | None = None,
) -> tuple[dict, dict[str, LayerStats], dict[str, dict[str, float]]]:
  """Runs AWQ on every fold group (and the clip search on every op).

  Args:
    params: the float parameters (nested dict).
    fold_map: the model's fold groups (`fold.detect` for the known LMs).
    stats: calibration stats keyed by each weight's path.
    configs: each weight's quantizer (its rule config's `fwd.rhs`; None
      or missing: the op stays float and counts for nothing).
    method: the AWQ settings (default `Awq()`).

  Returns:
    (new float params: folded scales and clipped weights, whose RTN with
    the same configs is AWQ's result; the stats of the new inputs; per
    group or unfolded op {'alpha', 'rtn_error', 'error'}: output errors
    `||X dW||^2` summed over the quantized consumers, before (RTN) and
    after).
  """
  method = method or Awq()
  fold.check(params, fold_map)
  cfgs = {p: _usable(p, c) for p, c in configs.items()}
  out, new_stats, info = dict(params), dict(stats), {}
  alphas = jnp.asarray(method.alphas, jnp.float32)
  for g in fold_map.groups:
    quant = tuple(a for a in g.consumers if cfgs.get(a.path) is not None)
    if not quant:
      continue
    sts = [_stats(stats, f'consumer of {g.name!r}', a.path) for a in quant]
    ws = tuple(fold.get(out, a.path) for a in quant)
    rtn_err = sum(
      _rtn_error(w, st.xtx, cfgs[a.path], a.axis % w.ndim, a.path)
      for w, st, a in zip(ws, sts, quant, strict=True)
    )
    pairs = zip(sts, quant, strict=True)
    means = [fold.reduce(st.mean_abs, a, 'mean') for st, a in pairs]
    m = sum(means[1:], means[0]) / len(quant)
    wm = None
    if method.duo:
      pairs = zip(ws, quant, strict=True)
      wms = [weight_mean(w, cfgs[a.path], a) for w, a in pairs]
      wm = sum(wms[1:], wms[0]) / len(quant)
    errs = scale_errors(
      ws,
      tuple(st.xtx for st in sts),
      m,
      alphas,
      wm,
      cfgs=tuple(cfgs[a.path] for a in quant),
      axes=quant,
    )
    best = int(jnp.argmin(errs))
    if float(errs[best]) < rtn_err:
      s, alpha = scales(m, alphas[best], wm), float(method.alphas[best])
    else:  # No candidate beats s = 1 (round to nearest).
      s, alpha = jnp.ones_like(m), float('nan')
    out = fold.apply(out, g, s)
    before = {}
    for a in g.consumers:
      if a.path in stats:
        new_stats[a.path] = fold.scale_stats(stats[a.path], fold.expand(s, a))
      before[a.path] = fold.get(out, a.path)
    out, err = _finish(out, quant, before, new_stats, cfgs, method)
    info[g.name] = {
      'alpha': alpha,
      'rtn_error': rtn_err,
      'error': err,
    }
  for path in fold_map.unfolded:
    if cfgs.get(path) is None:
      continue
    st = _stats(stats, 'unfolded op', path)
    w = fold.get(out, path)
    ax = fold.Axis(path=path)
    rtn_err = _rtn_error(w, st.xtx, cfgs[path], 0, path)
    out, err = _finish(out, (ax,), {path: w}, new_stats, cfgs, method)
    info[path] = {'alpha': 0.0, 'rtn_error': rtn_err, 'error': err}
  return out, new_stats, info
