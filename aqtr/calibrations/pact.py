"""PACT: the activation clip is a learned parameter."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.calibrations.base import (
  StatefulCalibration,
  learned_magnitude,
  nonfinite_guard,
  register,
)


@register('pact')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Pact(StatefulCalibration):
  """PACT learned clipping (Choi et al. 2018, arXiv 1805.06085).

  bound = |alpha|, learned per scale group: y = clip(x, -alpha, alpha) is
  quantized on the numerics' grid with step alpha / QP. With rounding
  passed straight through (eq. 3 of the paper):

    d y_q / d alpha = sign(x) * 1[|x| >= alpha],   d y_q / d x = 1[|x| < alpha]

  which for non-negative activations (after a ReLU) is the paper's
  1[x >= alpha]. The clip used is max(|alpha|, 2^-126) (alpha = 0 clips
  everything to ~0) and its gradient is d/d alpha of that: the formula
  above times sign(alpha) (sign(0) = +1), so an optimizer moves |alpha|
  the right way from a negative alpha too. Its L2 regulariser
  `penalty = l2 * sum alpha^2` is exposed (`Pact.penalty`,
  `aqtr.state.penalty`) for the loss.

  State: {'learned': {'clip': [*group]}}.

  Attributes:
    init_clip: initial alpha (> 0), or None for max |x| over the finite
      values of the operand given to `aqtr.state.init` (the paper starts
      from 10).
    l2: the weight of the L2 penalty on alpha (>= 0).

  Example:
    >>> import jax.numpy as jnp
    >>> st = Pact(init_clip=6.0).init_state(jnp.ones((1, 1, 2, 2)), (3,), None)
    >>> st['learned']['clip'].ravel().tolist()
    [6.0, 6.0]
  """

  init_clip: float | None = None
  l2: float = 0.0

  has_learned = True
  init_from_data = True

  def __post_init__(self):
    super().__post_init__()
    c = self.init_clip
    if c is not None and (
      isinstance(c, bool)
      or not isinstance(c, int | float)
      or not (math.isfinite(c) and c > 0)
    ):
      raise ValueError(
        f'Pact.init_clip must be None or a finite float > 0, got {c!r}.'
      )
    w = self.l2
    if isinstance(w, bool) or not isinstance(w, int | float):
      raise TypeError(f'Pact.l2 must be a float >= 0, got {w!r}.')
    if not (math.isfinite(w) and w >= 0):
      raise ValueError(f'Pact.l2 must be a finite float >= 0, got {w}.')

  def init_state(self, x, axes: Sequence[int], numerics) -> dict:
    del numerics
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    if self.init_clip is not None:
      clip = jnp.full(shape, self.init_clip, jnp.float32)
    elif isinstance(x, jax.Array):
      finite = jnp.where(jnp.isfinite(x), jnp.abs(x), 0)
      clip = jnp.max(finite, axis=tuple(axes), keepdims=True)
      clip = jnp.where(clip > 0, clip, 1.0).astype(jnp.float32)
    else:
      raise ValueError(
        'Pact with init_clip=None reads the operand values: set init_clip '
        'or use it on a forward operand.'
      )
    return {'stats': {}, 'learned': {'clip': clip}}

  def bound_with_state(self, x, axes, numerics, state):
    del numerics
    clip, _ = learned_magnitude(state['learned']['clip'])
    return clip + nonfinite_guard(x, axes), state

  def value_grad(self, x, s, numerics, state):
    del s, numerics
    clip, sign = learned_magnitude(state['learned']['clip'])
    out = jnp.abs(x) >= clip
    return {'clip': jnp.where(out, jnp.sign(x), 0.0) * sign}, ~out

  def penalty(self, state: dict) -> jax.Array:
    """l2 * sum(alpha^2): add to the loss."""
    return self.l2 * jnp.sum(jnp.square(state['learned']['clip']))
