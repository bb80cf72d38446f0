"""N:M structured sparsity: n of every m elements along the contraction."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.sparsity.base import Sparsity, register


def _int_field(owner, name: str, low: int, high: int | None = None) -> None:
  v = getattr(owner, name)
  ok = not isinstance(v, bool) and isinstance(v, int) and v >= low
  if ok and (high is None or v <= high):
    return
  allowed = f'>= {low}' if high is None else f'in {low}..{high}'
  raise ValueError(
    f'{type(owner).__name__}.{name} must be an int {allowed}, got {v!r}.'
  )


@register('n_m')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NM(Sparsity):
  """N:M structured sparsity along the contraction: n of every m kept.

  Math. The contraction K of the operand (its contraction axes flattened
  in dot order) is cut into units of `block` consecutive elements, each
  scored by `sum |x|` over the unit, and the units into groups of m:
  adjacent units (offset 0) or, with offset o > 0, units o apart (group j
  of each span of o*m units holds units j, j+o, ..., j+(m-1)*o). In each
  group the n units with the largest scores are kept (ties: the lower
  index), the others zeroed:

    M[g, i] = 1  iff  i in top_n(score[g, 0..m-1])

  so every group keeps exactly n units. A NaN scores +inf (kept, so it
  reaches the output). 2:4 (n=2, m=4) is the pattern sparse tensor cores
  run at twice the dense rate (Mishra et al. 2021, arXiv 2104.08378);
  trained with the straight-through gradient or SR-STE (`decay`, Zhou et
  al. 2021, arXiv 2102.04010). K must be a multiple of
  `span = m * block * max(offset, 1)`.

  Attributes:
    n: units kept per group, 1 <= n < m.
    m: units per group, 2..256 (serving stores indices as uint8).
    block: elements per unit (pruned together), >= 1.
    offset: 0 for adjacent units; o > 0 for units o apart.
    start_step: the first step the mask applies (dense before), >= 0.
    update_step: the mask is refreshed every `update_step` steps, >= 1.
    decay: SR-STE: adds `decay * (1 - M) * x` to the gradient, >= 0.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[[1.0, -3.0, 2.0, 0.5]]])
    >>> NM(n=2, m=4).mask(x, axis=2).astype(int).tolist()
    [[[0, 1, 1, 0]]]
  """

  n: int = 2
  m: int = 4
  block: int = 1
  offset: int = 0
  start_step: int = 0
  update_step: int = 1
  decay: float = 0.0

  def __post_init__(self):
    _int_field(self, 'm', 2, 256)
    _int_field(self, 'n', 1)
    if self.n >= self.m:
      raise ValueError(
        f'NM.n must be < NM.m (keep n of every m), got n={self.n}, m={self.m}.'
      )
    _int_field(self, 'block', 1)
    _int_field(self, 'offset', 0)
    self.check_schedule()

  @property
  def span(self) -> int:
    """Elements of one span of groups: m * block * max(offset, 1)."""
    return self.m * self.block * max(self.offset, 1)

  def check_size(self, k: int) -> None:
    if k % self.span:
      raise ValueError(
        f'{self!r} needs the contraction size to be a multiple of '
        f'm * block * max(offset, 1) = {self.span}, got {k}.'
      )

  def groups(self, x: jax.Array) -> jax.Array:
    """[..., K] -> [..., G, m, block]: the units of each group, in order."""
    *lead, k = x.shape
    self.check_size(k)
    m, b, o = self.m, self.block, max(self.offset, 1)
    x5 = x.reshape(*lead, k // (m * o * b), m, o, b)
    x5 = jnp.swapaxes(x5, -3, -2)  # [..., S, o, m, b]
    return x5.reshape(*lead, k // (m * b), m, b)

  def ungroup(self, g: jax.Array) -> jax.Array:
    """The inverse of `groups`: [..., G, m, block] -> [..., K]."""
    *lead, ng, m, b = g.shape
    o = max(self.offset, 1)
    g5 = g.reshape(*lead, ng // o, o, m, b)
    return jnp.swapaxes(g5, -3, -2).reshape(*lead, ng * m * b)

  def mask(self, x: jax.Array, axis: int) -> jax.Array:
    g = self.groups(jnp.moveaxis(jnp.abs(x), axis, -1))
    score = g.astype(jnp.float32).sum(-1)  # [..., G, m]
    score = jnp.where(jnp.isnan(score), jnp.inf, score)
    _, idx = lax.top_k(score, self.n)  # [..., G, n]
    slots = jnp.arange(self.m).reshape((1,) * idx.ndim + (self.m,))
    keep = (idx[..., None] == slots).any(-2)
    keep = jnp.broadcast_to(keep[..., None], g.shape)
    return jnp.moveaxis(self.ungroup(keep), -1, axis)
