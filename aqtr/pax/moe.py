"""Mixture-of-experts feed-forward: a top-k router and ragged expert dots.

Math (Shazeer et al. 2017, arXiv 1701.06538; top-k with renormalised gates
as in Mixtral, Jiang et al. 2024, arXiv 2401.04088). For each token x:

  p = softmax(router(x))          over E experts
  (w, e) = top_k(p, k);  w <- w / sum(w)
  y = sum_j w_j * wo_{e_j}(act(wi_gate_{e_j}(x)) * wi_{e_j}(x))   (gated)
  y = sum_j w_j * wo_{e_j}(act(wi_{e_j}(x)))                       (plain)

The T*k (token, expert) pairs are sorted by expert, so each expert's
tokens are consecutive rows and every expert projection is one
`ragged_dot` over [T*k, .] rows with `group_sizes` = tokens per expert.
Each expert projection is an injectable `RaggedDotOp` (paths `ffn.wi`,
`ffn.wi_gate`, `ffn.wo`, tagged `WeightOp`); the router is a `Linear`
(`ffn.router.einsum`), so `inject` quantizes it all like any other op.
The Switch load-balancing loss (Fedus et al. 2021, arXiv 2101.03961),
E * sum_e f_e P_e, is sown as intermediates 'load_balancing_loss'.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from aqtr.pax import templates
  >>> import fiddle as fdl
  >>> moe = fdl.build(templates.moe_feed_forward(8, 16, num_experts=4))
  >>> x = jnp.ones((2, 3, 8))
  >>> params = moe.init(jax.random.key(0), x)
  >>> moe.apply(params, x).shape
  (2, 3, 8)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.pax import ops, tags
from aqtr.pax.linear import Initializer, Linear

__all__ = ['MoeFeedForward', 'route']


def route(logits: jax.Array, top_k: int):
  """Top-k routing of [T, E] logits, sorted by expert.

  Returns:
    (token [T*k], weight [T*k], group_sizes [E]): for each (token, expert)
    pair in expert order, the token's row, its renormalised gate weight,
    and the number of pairs per expert.

  Example:
    >>> import jax.numpy as jnp
    >>> tok, w, gs = route(jnp.array([[0.0, 1.0], [2.0, 0.0]]), 1)
    >>> tok.tolist(), w.tolist(), gs.tolist()
    ([1, 0], [1.0, 1.0], [1, 1])
  """
  t, e = logits.shape
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_p, top_e = jax.lax.top_k(probs, top_k)  # [T, k]
  top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  experts = top_e.reshape(-1)
  order = jnp.argsort(experts, stable=True)
  token = (jnp.arange(t * top_k, dtype=jnp.int32) // top_k)[order]
  group_sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
  return token, top_p.reshape(-1)[order], group_sizes


class MoeFeedForward(nn.Module):
  """Top-k routed experts over the last axis: [..., d] -> [..., d].

  Attributes:
    num_experts: E.
    hidden_dim: each expert's hidden size.
    router: a `Linear` d -> E (no bias) giving the routing logits.
    wi, wo, wi_gate: the expert projections' ragged-dot ops (None: float);
      `wi_gate` is used only when `gated`.
    top_k: experts per token.
    gated: gated experts `act(wi_gate x) * wi x` (GLU family).
    activation: elementwise activation.
    kernel_init: initializer of the expert kernels (parameters
      `wi_kernel`, `wo_kernel`, `wi_gate_kernel`: [E, d, h] / [E, h, d]).
  """

  num_experts: int
  hidden_dim: int
  router: Linear
  wi: Annotated[ops.RaggedDotOp | None, tags.WeightOp] = None
  wo: Annotated[ops.RaggedDotOp | None, tags.WeightOp] = None
  wi_gate: Annotated[ops.RaggedDotOp | None, tags.WeightOp] = None
  top_k: int = 2
  gated: bool = False
  activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu
  kernel_init: Initializer = nn.initializers.lecun_normal(batch_axis=(0,))

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., d] -> [..., d]."""
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(
        f'MoeFeedForward.top_k must be in [1, num_experts={self.num_experts}]'
        f', got {self.top_k}.'
      )
    d, e, h = x.shape[-1], self.num_experts, self.hidden_dim
    tokens = x.reshape(-1, d)
    logits = self.router(tokens)
    token, weight, group_sizes = route(logits, self.top_k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    frac = group_sizes.astype(jnp.float32) / token.shape[0]
    self.sow(
      'intermediates',
      'load_balancing_loss',
      e * jnp.sum(frac * jnp.mean(probs, axis=0)),
    )
    xs = tokens[token]
    wi = self.param('wi_kernel', self.kernel_init, (e, d, h))
    wo = self.param('wo_kernel', self.kernel_init, (e, h, d))
    hidden = ops.ragged_dot(self.wi, xs, wi.astype(x.dtype), group_sizes)
    if self.gated:
      wg = self.param('wi_gate_kernel', self.kernel_init, (e, d, h))
      gate = ops.ragged_dot(self.wi_gate, xs, wg.astype(x.dtype), group_sizes)
      hidden = self.activation(gate) * hidden
    else:
      hidden = self.activation(hidden)
    y = ops.ragged_dot(self.wo, hidden, wo.astype(x.dtype), group_sizes)
    y = y * weight[:, None].astype(y.dtype)
    out = jnp.zeros_like(tokens).at[token].add(y.astype(x.dtype))
    return out.reshape(x.shape)
