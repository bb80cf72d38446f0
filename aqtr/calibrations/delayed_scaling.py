"""Delayed scaling: the bound is the max of the last L amax values."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from aqtr.calibrations.base import (
  StatefulCalibration,
  group_shape,
  nonfinite_guard,
  register,
)


@register('delayed_scaling')
@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling(StatefulCalibration):
  """bound_t = max(amax_{t-L}, ..., amax_{t-1}) per scale group.

  Transformer Engine's and FP8-LM's delayed scaling (Peng et al. 2023,
  arXiv 2310.18313): the scale of step t comes from the amax history of
  the previous L steps, so no reduction over the current tensor sits in
  front of the cast. The current amax_t = max_G |x_t| enters the history
  (newest first) for the next steps. With an empty history (all zero: the
  first step) the bound is amax_t. Per tensor or per channel, as the
  tiling says. On a gradient operand (dlhs.lhs, drhs.lhs) the history is
  updated by the backward pass (see `aqtr.state`); it records the amax of
  the tensor actually quantized there: with `use_fwd_quant` that is g
  times the partner's forward scale (folded in before quantizing).

  Non-finite values. A NaN/inf in the current group makes this step's
  bound non-finite (its outputs are NaN, as with `lax`), but it does not
  enter the history: a non-finite amax_t is recorded as 0, an empty
  entry. Non-finite entries already in a history (a state made or edited
  elsewhere) are ignored like empty ones, so the bound is the max of the
  finite entries (amax_t if none is > 0): one bad step never poisons the
  next L.

  State: {'stats': {'history': [L, *group]}}.

  Attributes:
    history_length: L, the number of past amax values kept (>= 1).

  Example:
    >>> import jax.numpy as jnp
    >>> c = DelayedScaling(history_length=2)
    >>> s = c.init_state(jnp.zeros((1, 1, 1, 2)), (3,), None)
    >>> b, s = c.bound_with_state(jnp.array([[[[1., -3.]]]]), (3,), None, s)
    >>> b, s = c.bound_with_state(jnp.array([[[[1., 2.]]]]), (3,), None, s)
    >>> float(b.squeeze()), s['stats']['history'].ravel().tolist()
    (3.0, [2.0, 3.0])
  """

  history_length: int = 16

  def __post_init__(self):
    super().__post_init__()
    n = self.history_length
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(
        f'DelayedScaling.history_length must be an int >= 1, got {n!r}.'
      )

  def init_state(self, x, axes: Sequence[int], numerics) -> dict:
    del numerics
    shape = (self.history_length,) + group_shape(x.shape, axes)
    return {'stats': {'history': jnp.zeros(shape, jnp.float32)}, 'learned': {}}

  def bound_with_state(self, x, axes, numerics, state):
    del numerics
    hist = state['stats']['history']
    amax = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)
    past = jnp.max(jnp.where(jnp.isfinite(hist), hist, 0), axis=0)
    bound = jnp.where(past > 0, past, amax) + nonfinite_guard(x, axes)
    entry = jnp.where(jnp.isfinite(amax), amax, 0).astype(hist.dtype)
    new = jnp.concatenate([entry[None], hist[:-1]], axis=0)
    return bound, {'stats': {'history': new}, 'learned': {}}
