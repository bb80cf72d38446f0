"""Running statistics of |x| (AQTv1's stats) and the bound made from them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

from aqtr.calibrations.base import (
  StatefulCalibration,
  group_shape,
  nonfinite_guard,
  register,
)

_STATS = ('l1', 'lp', 'max')


def _is_num(v) -> bool:
  return (
    not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
  )


@register('ema_stats')
@dataclasses.dataclass(frozen=True, kw_only=True)
class EmaStats(StatefulCalibration):
  """bound = c1 * l1 + c2 * lp + c3 * maxdev + c0 from running statistics.

  AQTv1's statistics-based calibration (Abdolrashidi et al. 2021, arXiv
  2105.03536). Per scale group and step t, over the elements kept (all,
  or the non-zero ones with `exclude_zeros`; a group with none kept does
  not update):

    a_t = mean |x|,  b_t = mean |x|^p,  m_t = max |x|
    n_t = min(n_{t-1} + 1, ema_update_count)          (n_0 = prior_count)
    S_t = S_{t-1} + (stat_t - S_{t-1}) / n_t          for S in l1, lp^p, max

  i.e. the running mean for the first steps, then an EMA with decay
  1 - 1/ema_update_count; the priors enter as `prior_count` earlier
  steps. From call `freeze_step` on (counting from 0), the statistics
  stop changing. NaN/inf values are left out of the statistics (the
  step's bound is still NaN, so its outputs are NaN as with `lax`): one
  bad batch never poisons the running statistics.
  bound = c1 * S_l1 + c2 * (S_lp)^(1/p) + c3 * S_max + c0, from the
  statistics including the current step.

  Per-example weights (`example_weights=True`, activations: the lhs of a
  dot): the state holds a weight per row (token) of the operand, set
  before each call with `aqtr.state.with_example_weights`; the means
  become weighted means sum(w |x|) / sum(w), rows of weight 0 (padding)
  are left out of every statistic, and the kept count is sum(w).

  State: {'stats': {'count', 'l1', 'lp', 'max': [*group], 'step': []}}.

  Attributes:
    p: the exponent of the lp statistic (> 0).
    c0, c1, c2, c3: the bound's coefficients (finite, >= 0, not all 0).
    ema_update_count: N, the cap of the running count (>= 1).
    prior_count: weight of the priors, in steps (>= 0).
    prior_l1, prior_lp, prior_max: prior values of mean |x|, mean |x|^p,
      max |x| (>= 0).
    exclude_zeros: leave exact zeros out of the statistics.
    freeze_step: stop updating after this many calls (None: never).
    example_weights: keep a weight per row in the state (default 1).

  Example:
    >>> import jax.numpy as jnp
    >>> c = EmaStats(c1=0.0, c3=1.0)
    >>> s = c.init_state(jnp.zeros((1, 1, 1, 2)), (3,), None)
    >>> b, s = c.bound_with_state(jnp.array([[[[2., 0.]]]]), (3,), None, s)
    >>> b, s = c.bound_with_state(jnp.array([[[[4., 0.]]]]), (3,), None, s)
    >>> float(b.squeeze())
    3.0
  """

  p: float = 2.0
  c0: float = 0.0
  c1: float = 3.0
  c2: float = 0.0
  c3: float = 0.0
  ema_update_count: int = 100
  prior_count: float = 0.0
  prior_l1: float = 0.0
  prior_lp: float = 0.0
  prior_max: float = 0.0
  exclude_zeros: bool = False
  freeze_step: int | None = None
  example_weights: bool = False

  def __post_init__(self):
    super().__post_init__()
    name = 'EmaStats'
    if not _is_num(self.p) or self.p <= 0:
      raise ValueError(f'{name}.p must be a finite float > 0, got {self.p!r}.')
    for f in (
      'c0',
      'c1',
      'c2',
      'c3',
      'prior_count',
      'prior_l1',
      'prior_lp',
      'prior_max',
    ):
      v = getattr(self, f)
      if not _is_num(v) or v < 0:
        raise ValueError(f'{name}.{f} must be a finite float >= 0, got {v!r}.')
    if not any(getattr(self, f) > 0 for f in ('c0', 'c1', 'c2', 'c3')):
      raise ValueError(
        f'{name}.c0, c1, c2, c3 are all 0, so the bound would be 0 (and the '
        'scale silently 1): set at least one > 0 (the default is c1=3).'
      )
    n = self.ema_update_count
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(
        f'{name}.ema_update_count must be an int >= 1, got {n!r}.'
      )
    for f in ('exclude_zeros', 'example_weights'):
      if not isinstance(getattr(self, f), bool):
        raise TypeError(f'{name}.{f} must be a bool, got {getattr(self, f)!r}.')
    f = self.freeze_step
    if f is not None and (
      isinstance(f, bool) or not isinstance(f, int) or f < 0
    ):
      raise ValueError(
        f'{name}.freeze_step must be None or an int >= 0, got {f!r}.'
      )

  def init_state(self, x, axes: Sequence[int], numerics) -> dict:
    del numerics
    g = group_shape(x.shape, axes)

    def full(v):
      return jnp.full(g, v, jnp.float32)

    stats = {
      'count': full(self.prior_count),
      'l1': full(self.prior_l1),
      'lp': full(self.prior_lp),
      'max': full(self.prior_max),
      'step': jnp.zeros((), jnp.float32),
    }
    if self.example_weights:  # Rows of the [B, T, F, t] view: (B, F).
      stats['weights'] = jnp.ones((x.shape[0], 1, x.shape[2], 1), jnp.float32)
    return {'stats': stats, 'learned': {}}

  def batch_stats(self, x, axes, weights=None):
    """(kept count, mean |x|, mean |x|^p, max |x|) per group.

    `weights`: per-row weights broadcastable to x (None: all 1).
    """
    ax = tuple(axes)
    a = jnp.abs(x)
    w = (a != 0) if self.exclude_zeros else jnp.ones_like(a, bool)
    w = w & jnp.isfinite(a)  # A NaN/inf never enters (the guard surfaces it).
    wf = w.astype(jnp.float32)
    if weights is not None:
      w = w & (weights > 0)
      wf = jnp.where(w, weights, 0)
    n = jnp.sum(wf, axis=ax, keepdims=True)
    safe = jnp.where(n > 0, n, 1)
    l1 = jnp.sum(jnp.where(w, wf * a, 0), axis=ax, keepdims=True) / safe
    lp = jnp.sum(jnp.where(w, wf * a**self.p, 0), axis=ax, keepdims=True)
    mx = jnp.max(jnp.where(w, a, 0), axis=ax, keepdims=True)
    return n, {'l1': l1, 'lp': lp / safe, 'max': mx}

  def bound_from(self, st) -> jnp.ndarray:
    lp = jnp.maximum(st['lp'], 0) ** (1 / self.p)
    return self.c1 * st['l1'] + self.c2 * lp + self.c3 * st['max'] + self.c0

  def bound_with_state(self, x, axes, numerics, state):
    del numerics
    st = state['stats']
    n_b, batch = self.batch_stats(x, axes, st.get('weights'))
    live = n_b > 0
    if self.freeze_step is not None:
      live = live & (st['step'] < self.freeze_step)
    count = jnp.minimum(st['count'] + 1, self.ema_update_count)
    count = jnp.where(live, count, st['count'])
    rate = jnp.where(live, 1 / jnp.maximum(count, 1), 0)
    new = {k: st[k] + rate * (batch[k] - st[k]) for k in _STATS}
    new['count'] = count
    stepped = st['step'] + 1
    if self.freeze_step is not None:
      stepped = jnp.minimum(stepped, self.freeze_step)
    new['step'] = stepped
    if 'weights' in st:
      new['weights'] = st['weights']
    bound = jnp.maximum(self.bound_from(new), 0) + nonfinite_guard(x, axes)
    return bound, {'stats': new, 'learned': {}}


@register('mean_absmax')
@dataclasses.dataclass(frozen=True, kw_only=True)
class MeanAbsMax(StatefulCalibration):
  """bound_t = (1/t) sum_{i<=t} max_G |x_i|: a static range, averaged.

  The mean over the steps it has seen (e.g. the CALIBRATE steps) of the
  per-step absolute maximum, per scale group: the usual static-range
  calibration of post-training quantization (Jacob et al. 2018, arXiv
  1712.05877, "averaged min/max"). A step whose group holds a NaN/inf
  gets a NaN bound (its outputs are NaN, as with `lax`) and is not
  counted. State: {'stats': {'count', 'mean'}}.

  Example:
    >>> import jax.numpy as jnp
    >>> c = MeanAbsMax()
    >>> s = c.init_state(jnp.zeros((1, 1, 1, 2)), (3,), None)
    >>> b, s = c.bound_with_state(jnp.array([[[[2., 0.]]]]), (3,), None, s)
    >>> b, s = c.bound_with_state(jnp.array([[[[4., 0.]]]]), (3,), None, s)
    >>> float(b.squeeze())
    3.0
  """

  def init_state(self, x, axes: Sequence[int], numerics) -> dict:
    del numerics
    g = group_shape(x.shape, axes)
    z = jnp.zeros(g, jnp.float32)
    return {'stats': {'count': z, 'mean': z}, 'learned': {}}

  def bound_with_state(self, x, axes, numerics, state):
    del numerics
    st = state['stats']
    amax = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)
    ok = jnp.isfinite(amax)
    count = jnp.where(ok, st['count'] + 1, st['count'])
    step = jnp.where(ok, amax - st['mean'], 0) / jnp.maximum(count, 1)
    mean = st['mean'] + step
    new = {'count': count, 'mean': mean}
    return mean + nonfinite_guard(x, axes), {'stats': new, 'learned': {}}
