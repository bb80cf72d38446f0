"""Linear projection over the last axis through an injectable einsum.

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> layer = Linear(features=3, einsum=aqtr.pax.EinsumOp())
  >>> params = layer.init(jax.random.key(0), jnp.ones((2, 4)))
  >>> jax.tree.map(jnp.shape, params['params'])
  {'bias': (3,), 'kernel': (4, 3)}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import flax.linen as nn
import jax

from aqtr.pax import ops, tags

__all__ = ['Linear', 'add_bias']

Initializer = Callable[..., Any]


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
  """`y + b` with `b` over the last axis, without implicit rank promotion.

  Example:
    >>> import jax.numpy as jnp
    >>> add_bias(jnp.zeros((2, 3)), jnp.arange(3.0)).tolist()
    [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
  """
  return y + b.reshape((1,) * (y.ndim - 1) + b.shape)


class Linear(nn.Module):
  """y = x . W (+ b), W of shape [in, features] (Pax's Linear + Bias).

  The contraction is `einsum('...d,df->...f', x, W)` through the op field
  `einsum` (None: float). The weight is the op's rhs operand.

  Attributes:
    features: output size.
    einsum: the injectable op (tagged `WeightOp`).
    use_bias: add a learned bias.
    kernel_init: initializer of W.
    bias_init: initializer of b.
  """

  features: int
  einsum: Annotated[ops.EinsumOp | None, tags.WeightOp] = None
  use_bias: bool = True
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Projects the last axis of `x` to `features`."""
    w = self.param('kernel', self.kernel_init, (x.shape[-1], self.features))
    y = ops.einsum(self.einsum, '...d,df->...f', x, w)
    if self.use_bias:
      y = add_bias(y, self.param('bias', self.bias_init, (self.features,)))
    return y
