"""DeepMind gemma's own `Sampler` with a cache stored by `CacheRule`.

gemma's `sampler.Sampler(transformer, vocab, params, cache_length=S)`
keeps the cache {'layer_i': {'k', 'v', 'end_index'}} in its sampling
state and calls `transformer.apply({'params': params}, tokens, positions,
cache, mask)` in its own `lax.while_loop`, making the cache with
`transformer.config.init_cache`. `SamplerTransformer(transformer, kv)`
is a stand-in for the transformer with those two entry points: its
cache is stored quantized (int8, packed int4, fp8 codes + scales) and
each call dequantizes it, runs gemma's own Transformer and stores what
it left. The Sampler's code runs unmodified.

Weights converted by `aqtr.flax.convert` work too: pass the served
module, and give the Sampler the whole served variables dict as `params`
(a converted model may keep frozen values in collections beside
'params', which the Sampler would not pass on).

Example (`vocab`: a SentencePiece processor of the model):

  served, svars = aqtr.flax.convert(q, ids, pos, None, mask,
                                    variables={'params': params})
  s = sampler.Sampler(SamplerTransformer(served, 'int8'), vocab, svars,
                      cache_length=256)
  s(['The capital of France is'], total_generation_steps=16)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from aqtr.flax import decode

__all__ = ['SamplerTransformer']


class _Config:
  """The transformer's config; `init_cache` returns the stored cache."""

  def __init__(self, config: Any, rules: tuple):
    self._config, self._rules = config, rules

  def __getattr__(self, name: str) -> Any:
    return getattr(self._config, name)

  def init_cache(self, batch_size: int, dtype: Any = jnp.float32, **kw):
    if not jnp.issubdtype(dtype, jnp.floating):
      dtype = jnp.float32  # The Sampler's dtype of frozen int8 params.
    cache = self._config.init_cache(batch_size, dtype, **kw)
    return decode.store_tree(self._rules, cache)[0]


class SamplerTransformer:
  """A gemma Transformer as gemma's Sampler calls it, its cache by rule.

  Args:
    transformer: a `gemma.transformer.Transformer` (or the module
      `aqtr.flax.convert` served).
    kv: a format name ('none', 'int8', 'int4', 'fp8': for the layers'
      'k' and 'v'), or `CacheRule`s.

  Example (see the module's): `sampler.Sampler(SamplerTransformer(
  transformer, 'int4'), vocab, params, cache_length=256)`.
  """

  def __init__(self, transformer: Any, kv: Any = 'int8'):
    config = getattr(transformer, 'config', None)
    if not hasattr(config, 'init_cache') or not hasattr(config, 'num_embed'):
      raise TypeError(
        'SamplerTransformer: transformer must be a gemma.transformer.'
        f'Transformer, got {type(transformer).__name__}.'
      )
    self.transformer = transformer
    self.rules = decode.rules_of(kv, ('k', 'v'))
    self.config = _Config(config, self.rules)

  def apply(self, variables, last_tokens, positions, cache, attention_mask):
    """gemma's `Transformer.apply`, reading and storing the cache by rule.

    `variables` is {'params': params} as the Sampler passes it; when
    `params` is itself a whole variables dict (it has 'params'), that
    dict is used.
    """
    inner = variables.get('params', {})
    if isinstance(inner, dict) and 'params' in inner:
      variables = inner
    logits, cache = self.transformer.apply(
      variables,
      last_tokens,
      positions,
      decode.load_tree(cache),
      attention_mask,
    )
    stored, used = decode.store_tree(self.rules, cache)
    hit = {i for _, i in used}
    for i, r in enumerate(self.rules):
      if i not in hit:
        names = [
          '/'.join(map(str, (getattr(k, 'key', k) for k in p)))
          for p, _ in jax.tree.leaves_with_path(cache)
        ]
        raise ValueError(
          f'SamplerTransformer: kv rule {i} ({r}) matched no cache '
          f'variable; the cache has {names}. Fix its path or names.'
        )
    return logits, stored
