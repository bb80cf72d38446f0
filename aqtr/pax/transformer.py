"""Pre-norm transformer block and a decoder-only transformer LM.

  Block          x + attention(norm(x)), then + ffn(norm(.))
  TransformerLm  embed -> + learned positions -> layers -> norm -> logits

`TransformerLm.layers` is a list of distinct block configs (see
`aqtr.pax.templates.transformer_lm`, which clones one block template), so
rules by index (`layers[0]` / `layers.0`) reach one layer. Parameters are
named after the fields (`layers_0/attention/q_proj/kernel`, ...); the op
fields hold no parameters, so injecting quantization keeps the tree.

Example:
  >>> import fiddle as fdl, jax, jax.numpy as jnp
  >>> from aqtr.pax import templates
  >>> cfg = templates.transformer_lm(vocab_size=16, d_model=8, num_layers=1,
  ...                                num_heads=2, hidden_dim=16, max_len=4)
  >>> lm = fdl.build(cfg)
  >>> ids = jnp.zeros((2, 4), jnp.int32)
  >>> params = jax.eval_shape(lm.init, jax.random.key(0), ids)
  >>> jax.eval_shape(lm.apply, params, ids).shape
  (2, 4, 16)
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.pax import kv_cache, sharding
from aqtr.pax.attention import Attention
from aqtr.pax.feedforward import FeedForward
from aqtr.pax.linear import Initializer

__all__ = ['Block', 'TransformerLm', 'next_token_loss']


class Block(nn.Module):
  """Pre-norm residual block: attention then feed-forward.

  Attributes:
    attention: the self-attention layer.
    ffn: the feed-forward layer.
    attention_norm: norm before the attention (e.g. `nn.RMSNorm`).
    ffn_norm: norm before the feed-forward.
  """

  attention: Attention
  ffn: FeedForward
  attention_norm: nn.Module
  ffn_norm: nn.Module

  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, time, d] -> [batch, time, d]."""
    x = x + self.attention(self.attention_norm(x))
    return x + self.ffn(self.ffn_norm(x))

  def extend(self, x, layer, cfg, index, start):
    """`__call__` on t new tokens through a cache (`Attention.extend`)."""
    h, layer = self.attention.extend(
      self.attention_norm(x), layer, cfg, index, start
    )
    x = x + h
    return x + self.ffn(self.ffn_norm(x)), layer


class TransformerLm(nn.Module):
  """Decoder-only LM: token ids [batch, time] -> logits [batch, time, V].

  Attributes:
    embedding: an `Embedding` (with `softmax` given) or a
      `SharedEmbeddingSoftmax` (tied: it also gives the logits).
    layers: the blocks, applied in order.
    final_norm: norm before the logits.
    softmax: the untied logits layer, or None to use `embedding`.
    max_len: number of learned positions (>= sequence length).
    position_init: initializer of the position table.
  """

  embedding: nn.Module
  layers: Sequence[Block]
  final_norm: nn.Module
  softmax: nn.Module | None = None
  max_len: int = 512
  position_init: Initializer = nn.initializers.normal(stddev=0.02)

  @nn.compact
  def __call__(self, ids: jax.Array) -> jax.Array:
    """Next-token logits of integer `ids` [batch, time]."""
    t = ids.shape[-1]
    if t > self.max_len:
      raise ValueError(
        f'TransformerLm: sequence length {t} exceeds max_len={self.max_len}.'
      )
    x = self.embedding.embed(ids)
    pos = self.param(
      'position_embedding', self.position_init, (self.max_len, x.shape[-1])
    )
    x = x + pos[:t].astype(x.dtype)[None]
    for layer in self.layers:
      x = layer(x)
    x = self.final_norm(x)
    head = self.softmax if self.softmax is not None else self.embedding
    return head(x)

  def extend(
    self,
    ids: jax.Array,
    cache: kv_cache.Cache,
    cfg: kv_cache.KVCacheConfig,
  ) -> tuple[jax.Array, kv_cache.Cache]:
    """Logits of t new tokens `ids` [batch, t] written at `cache.index`.

    Prefill is one call on the (left-padded) prompts with an empty cache;
    each decode step is a call on one token. Token slot p of sequence i has
    position p - cache.start[i]. Apply with `method='extend'` on the
    variables of `__call__` (see `aqtr.pax.decode`).

    Returns:
      (logits [batch, t, V], the cache with t more slots filled).
    """
    t = ids.shape[-1]
    x = self.embedding.embed(ids)
    table = self.variables['params']['position_embedding']
    slots = cache.index + jnp.arange(t)
    pos = jnp.clip(slots[None] - cache.start[:, None], 0, self.max_len - 1)
    x = x + jnp.take(table, pos, axis=0).astype(x.dtype)
    layers = []
    for layer, kv in zip(self.layers, cache.layers, strict=True):
      x, kv = layer.extend(x, kv, cfg, cache.index, cache.start)
      layers.append(kv)
    x = self.final_norm(x)
    head = self.softmax if self.softmax is not None else self.embedding
    cache = kv_cache.Cache(tuple(layers), cache.index + t, cache.start)
    return head(x), cache


def next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting ids[:, 1:] from logits[:, :-1].

  Example:
    >>> import jax.numpy as jnp
    >>> float(next_token_loss(jnp.zeros((1, 3, 4)), jnp.zeros((1, 3), int)))
    1.386...
  """
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.mean(sharding.pick(logp, ids[:, 1:]))
