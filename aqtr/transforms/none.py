"""No transform: the operands are quantized as they are (the default)."""

from __future__ import annotations

import dataclasses

import jax

from aqtr.transforms.base import Transform, register


@register('none')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NoTransform(Transform):
  """The identity `R = I`: `apply(x) = x`; the engine skips it.

  Example:
    >>> import jax.numpy as jnp
    >>> NoTransform().apply(jnp.array([1.0, -2.0]), 0).tolist()
    [1.0, -2.0]
  """

  transforms = False

  def apply(self, x, axis, key=None, operand='operand') -> jax.Array:
    del axis, key, operand
    return x

  def inverse(self, x, axis, key=None, operand='operand') -> jax.Array:
    del axis, key, operand
    return x
