"""LSQ: the quantization step is a learned parameter."""

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


@register('lsq')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Lsq(StatefulCalibration):
  """Learned Step Size Quantization (Esser et al. 2020, arXiv 1902.08153).

  The step s of each scale group is learned: bound = |s| * QP with
  QP = numerics.max_value, xhat = s * q, q = clip(round(x/s), -QN, QP)
  (QN = QP on the symmetric grid). Its gradient (straight-through through
  round, eq. 3 of the paper):

    d xhat / d s = round(x/s) - x/s   if -QN < x/s < QP
                 = -QN or QP          outside (the clipped value)

  scaled by g = 1 / sqrt(N * QP), N the number of elements sharing s (the
  scale group). The step used is max(|s|, 2^-126) (a step of exactly 0
  quantizes to ~0, like a tiny step) and its gradient is d/ds of that,
  i.e. the formula above times sign(s) (sign(0) = +1), so an optimizer
  moves |s| the right way from a negative step too. The input's gradient
  passes straight through inside the range and is zero outside. Init:
  s = 2 mean|x| / sqrt(QP) over the group's finite values (from the
  operand `aqtr.state.init` is given), so only forward operands can use
  it.

  State: {'learned': {'step': [*group]}}.

  Example:
    >>> import jax.numpy as jnp
    >>> from aqtr.numerics import IntSymmetric
    >>> n = IntSymmetric(bits=2, preserve_max_val=True)
    >>> st = Lsq().init_state(jnp.array([[[[1., -3.]]]]), (3,), n)
    >>> float(st['learned']['step'].squeeze())
    4.0
  """

  has_learned = True
  init_from_data = True

  def init_state(self, x, axes: Sequence[int], numerics) -> dict:
    if not isinstance(x, jax.Array):
      raise ValueError(
        'Lsq initialises its step from the operand values: use it on a '
        'forward operand (fwd.lhs or fwd.rhs), not on a gradient.'
      )
    qp = numerics.max_value
    ax, ok = tuple(axes), jnp.isfinite(x)  # NaN/inf do not enter the init.
    total = jnp.sum(jnp.where(ok, jnp.abs(x), 0), axis=ax, keepdims=True)
    count = jnp.sum(ok, axis=ax, keepdims=True)
    step = 2 * total / jnp.maximum(count, 1) / math.sqrt(qp)
    step = jnp.where(step > 0, step, 1.0).astype(jnp.float32)
    return {'stats': {}, 'learned': {'step': step}}

  def bound_with_state(self, x, axes, numerics, state):
    step, _ = learned_magnitude(state['learned']['step'])
    return step * numerics.max_value + nonfinite_guard(x, axes), state

  def value_grad(self, x, s, numerics, state):
    _, sign = learned_magnitude(state['learned']['step'])
    qp = numerics.max_value
    v = x / s
    inside = jnp.abs(v) < qp
    q = numerics.quantize(v).astype(jnp.float32) * numerics.unit
    return {'step': (q - jnp.where(inside, v, 0.0)) * sign}, inside

  def grad_scale(self, group_size: int, numerics) -> float:
    return 1.0 / math.sqrt(group_size * numerics.max_value)
