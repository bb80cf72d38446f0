"""No sparsity: every element is kept (the default of every operand)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from aqtr.sparsity.base import Sparsity, register


@register('none')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSparsity(Sparsity):
  """Keeps every element: `M = 1`, `x_s = x`; the engine skips it.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(NoSparsity().mask(jnp.zeros((1, 2, 4)), 2).all())
    True
  """

  prunes = False

  def mask(self, x: jax.Array, axis: int) -> jax.Array:
    del axis
    return jnp.ones(jnp.shape(x), jnp.bool_)
