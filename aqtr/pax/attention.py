"""Multi-head dot-product attention with every contraction injectable.

Six contractions, each its own op: the Q, K, V and output projections
(`Linear` children, ops tagged `WeightOp`) and the two activation-activation
einsums (tagged `ActivationOp`):

  qk_einsum   logits = einsum('btnh,bsnh->bnts', q, k)
  pv_einsum   out    = einsum('bnts,bsnh->btnh', probs, v)

Example:
  >>> import jax, jax.numpy as jnp
  >>> from aqtr.pax.linear import Linear
  >>> att = Attention(num_heads=2, q_proj=Linear(features=8),
  ...                 k_proj=Linear(features=8), v_proj=Linear(features=8),
  ...                 o_proj=Linear(features=4))
  >>> x = jnp.ones((1, 3, 4))
  >>> params = jax.eval_shape(att.init, jax.random.key(0), x)
  >>> jax.eval_shape(att.apply, params, x).shape
  (1, 3, 4)
"""

from __future__ import annotations

from typing import Annotated

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.pax import kv_cache, merged, ops, sharding, tags
from aqtr.pax.linear import Linear

__all__ = ['Attention']


class Attention(nn.Module):
  """Multi-head self-attention, causal by default.

  The projections map d -> num_heads * head_dim (Q, K, V) and back to d
  (output); head_dim is the projection size over num_heads. Queries are
  scaled by head_dim^-1/2; the softmax runs in float32.

  Attributes:
    q_proj, k_proj, v_proj: input projections.
    o_proj: output projection.
    num_heads: number of heads (divides the projection size).
    qk_einsum: op of the logits einsum (tagged `ActivationOp`).
    pv_einsum: op of the weighted-values einsum (tagged `ActivationOp`).
    causal: mask future positions.
  """

  q_proj: Linear
  k_proj: Linear
  v_proj: Linear
  o_proj: Linear
  num_heads: int = 1
  qk_einsum: Annotated[ops.EinsumOp | None, tags.ActivationOp] = None
  pv_einsum: Annotated[ops.EinsumOp | None, tags.ActivationOp] = None
  causal: bool = True

  def _heads(self, x: jax.Array) -> jax.Array:
    b, t, f = x.shape
    if f % self.num_heads:
      raise ValueError(
        f'Attention: projection size {f} is not divisible by num_heads='
        f'{self.num_heads}.'
      )
    return sharding.split_heads(x, self.num_heads)

  def _qkv(self, x: jax.Array) -> tuple[jax.Array, ...]:
    """The Q, K and V projections of x: one dot when served frozen
    (`merged.project`; the same values as three)."""
    return merged.project(self, ('q_proj', 'k_proj', 'v_proj'), x)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, time, d] -> [batch, time, d]."""
    q, k, v = map(self._heads, self._qkv(x))
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    logits = ops.einsum(self.qk_einsum, 'btnh,bsnh->bnts', q, k)
    logits = logits.astype(jnp.float32)
    if self.causal:
      t = x.shape[1]
      mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
      logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = ops.einsum(self.pv_einsum, 'bnts,bsnh->btnh', probs, v)
    return self.o_proj(sharding.merge_heads(out))

  def extend(
    self,
    x: jax.Array,
    layer: kv_cache.LayerCache,
    cfg: kv_cache.KVCacheConfig,
    index: jax.Array,
    start: jax.Array,
  ) -> tuple[jax.Array, kv_cache.LayerCache]:
    """Attention of t new tokens over a cache (prefill or one decode step).

    The new keys and values are written to slots index .. index + t - 1
    first (zeros before a sequence's `start`), then every query reads the
    cache: query slot p sees slots start .. p. With a float cache the
    outputs equal `__call__`'s on the whole sequence (to float rounding).

    Args:
      x: [batch, t, d] new tokens' inputs.
      layer: this layer's cache (S slots).
      cfg: how the cache stores and reads keys and values.
      index: int32 scalar, the slot of x's first token.
      start: int32 [batch], each sequence's first real slot.

    Returns:
      ([batch, t, d] outputs, the updated cache).
    """
    if not self.causal:
      raise ValueError('Attention.extend: decoding needs causal=True.')
    t = x.shape[1]
    q, k, v = map(self._heads, self._qkv(x))
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    slots = index + jnp.arange(t)
    real = (slots[None] >= start[:, None])[..., None, None]
    layer = kv_cache.write(
      cfg, layer, jnp.where(real, k, 0), jnp.where(real, v, 0), index
    )
    keys = jnp.arange(layer.k.codes.shape[2])
    mask = (keys[None, None] >= start[:, None, None]) & (
      keys[None, None] <= slots[None, :, None]
    )
    out = kv_cache.attend(
      cfg, layer, q, mask[:, None], self.qk_einsum, self.pv_einsum
    )
    return self.o_proj(sharding.merge_heads(out)), layer
