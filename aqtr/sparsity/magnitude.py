"""Unstructured magnitude sparsity: keep the largest fraction of elements."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.sparsity.base import Sparsity, register

_GRANULARITIES = ('tensor', 'row')


@register('magnitude')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Magnitude(Sparsity):
  """Unstructured sparsity: the largest `keep` fraction of |x| is kept.

  Math. Over a set S of elements (the whole operand, or each row: the
  elements one output sums over), with c = max(1, round(keep * |S|)):

    M[i] = 1  iff  |x_i| is among the c largest of S  (ties: lower index)

  so exactly c elements of S are kept. A NaN counts as +inf (kept). The
  classic magnitude pruning criterion (Han et al. 2015, arXiv 1506.02626;
  gradual schedules: Zhu & Gupta 2017, arXiv 1710.01878); gradient
  straight-through, or SR-STE with `decay` (Zhou et al. 2021, arXiv
  2102.04010). Unlike `n_m` it has no hardware pattern: it saves bytes
  only with a sparse storage format.

  Attributes:
    keep: fraction of elements kept, 0 < keep <= 1.
    granularity: 'tensor' (one ranking for the whole operand; for
      activations that mixes the examples of a batch) or 'row'.
    start_step: the first step the mask applies (dense before), >= 0.
    update_step: the mask is refreshed every `update_step` steps, >= 1.
    decay: SR-STE: adds `decay * (1 - M) * x` to the gradient, >= 0.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[[1.0, -3.0, 2.0, 0.5]]])
    >>> Magnitude(keep=0.25).mask(x, axis=2).astype(int).tolist()
    [[[0, 1, 0, 0]]]
  """

  keep: float = 0.5
  granularity: str = 'tensor'
  start_step: int = 0
  update_step: int = 1
  decay: float = 0.0

  def __post_init__(self):
    k = self.keep
    if (
      isinstance(k, bool) or not isinstance(k, (int, float)) or not (0 < k <= 1)
    ):
      raise ValueError(
        f'Magnitude.keep must be a fraction in (0, 1], got {k!r}.'
      )
    if self.granularity not in _GRANULARITIES:
      raise ValueError(
        f'Magnitude.granularity must be one of {_GRANULARITIES}, got '
        f'{self.granularity!r}.'
      )
    self.check_schedule()

  def count(self, size: int) -> int:
    """Elements kept of a set of `size`: max(1, round(keep * size))."""
    return max(1, min(size, int(math.floor(self.keep * size + 0.5))))

  def mask(self, x: jax.Array, axis: int) -> jax.Array:
    score = jnp.abs(x).astype(jnp.float32)
    score = jnp.where(jnp.isnan(score), jnp.inf, score)
    if self.granularity == 'row':
      score = jnp.moveaxis(score, axis, -1)
      rows = score.reshape(-1, score.shape[-1])
    else:
      rows = score.reshape(1, -1)
    c = self.count(rows.shape[-1])
    _, idx = lax.top_k(rows, c)
    keep = jnp.zeros(rows.shape, jnp.bool_)
    keep = keep.at[jnp.arange(rows.shape[0])[:, None], idx].set(True)
    if self.granularity == 'row':
      return jnp.moveaxis(keep.reshape(score.shape), -1, axis)
    return keep.reshape(jnp.shape(x))
