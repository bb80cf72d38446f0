"""Feed-forward block: plain `wo(act(wi x))` or gated `wo(act(g x) * wi x)`.

Each of the two (plain) or three (gated) projections is a `Linear` child
whose einsum op is injectable on its own (paths `ffn.wi.einsum`,
`ffn.wi_gate.einsum`, `ffn.wo.einsum`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from aqtr.pax.linear import Linear
  >>> ffn = FeedForward(wi=Linear(features=8), wo=Linear(features=4),
  ...                   wi_gate=Linear(features=8))
  >>> x = jnp.ones((2, 4))
  >>> params = jax.eval_shape(ffn.init, jax.random.key(0), x)
  >>> jax.eval_shape(ffn.apply, params, x).shape
  (2, 4)
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from aqtr.pax.linear import Linear

__all__ = ['FeedForward']


class FeedForward(nn.Module):
  """Two-layer MLP over the last axis, optionally gated (GLU family).

  Gated (Pax's `use_gated_activation`): `h = act(wi_gate(x)) * wi(x)`;
  plain: `h = act(wi(x))`; the output is `wo(h)`.

  Attributes:
    wi: input projection d -> hidden.
    wo: output projection hidden -> d.
    wi_gate: gate projection d -> hidden, or None for the plain block.
    activation: elementwise activation.
  """

  wi: Linear
  wo: Linear
  wi_gate: Linear | None = None
  activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu

  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., d] -> [..., d]."""
    if self.wi_gate is None:
      h = self.activation(self.wi(x))
    else:
      h = self.activation(self.wi_gate(x)) * self.wi(x)
    return self.wo(h)
