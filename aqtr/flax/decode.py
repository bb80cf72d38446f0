"""Decoding any stock Flax LM with its own cache, stored quantized by rule.

`Decoder(model, length=S, kv='int8')` generates from a stock LM (a Hugging
Face Flax causal LM, DeepMind gemma's Transformer, any linen LM with a
'cache' collection, an nnx LM with `nnx.Cache` variables: see
`aqtr.flax.stock_lm`), float or with weights converted by
`aqtr.flax.convert`, through the model's own fixed-size cache. The cache
the decoder carries between calls is stored as `aqtr.flax.kv_cache`
rules say (int8, packed int4, fp8 codes + per-token or per-block scales);
each call dequantizes it, runs the model's own code, and stores what the
model left. Under `jit`, as `aqtr.pax.Decoder` (sharing `aqtr.flax.sampling`:
`Sampling`, `sample`, `pad`, `Generation`):

  prefill   the left-padded prompts in one call (or one token a call for
            a model that takes one), filling slots 0..P-1
  step      one token per sequence
  generate  prefill, then a `lax.while_loop` of steps (greedy,
            temperature and top-k sampling with a seed); stops when the
            cache is full

Example (a Hugging Face Flax LM; its params are the default variables):

  hf = transformers.FlaxGPT2LMHeadModel(config)
  dec = Decoder(hf, length=256, kv='int8')
  out = dec.generate(None, [[1, 2, 3], [4]], max_new=32,
                     sampling=Sampling(temperature=0.8, top_k=40, seed=0))
  out.tokens, out.tokens_per_s, out.kv_bytes

  q = aqtr.flax.quantize(hf.module, [aqtr.Rule('int8', path='.*/h/.*')])
  served, svars = aqtr.flax.convert(q, ids, mask, positions,
                                    variables={'params': hf.params})
  Decoder(served, length=256, kv='int4').generate(svars, prompts, 32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.flax import kv_cache, stock_lm
from aqtr.flax.kv_cache import CacheRule, StoredCache
from aqtr.flax.sampling import BaseDecoder, pad, step_tokens
from aqtr.flax.sampling import Generation as Generation
from aqtr.flax.sampling import Sampling as Sampling

# Sampling, Generation and pad are re-exported from aqtr.flax.sampling.
__all__ = [
  'Decoder',
  'load_tree',
  'rules_of',
  'store_tree',
]


def _parts(keys) -> list[str]:
  out = []
  for k in keys:
    if isinstance(k, jax.tree_util.GetAttrKey):
      continue  # nnx Variable's `.value`.
    out.append(str(getattr(k, 'key', getattr(k, 'idx', k))))
  return out


def _is_stored(x) -> bool:
  return isinstance(x, StoredCache)


def store_tree(rules: Sequence[CacheRule], tree: Any) -> tuple[Any, list]:
  """(tree with the matched cache arrays stored, [(path, rule index)]).

  A leaf's path is its keys joined by '/' ('transformer/h/0/attn/
  cached_key'); the module path is all but the last part, which is the
  variable's name. The first matching rule wins.

  Example:
    >>> t, used = store_tree([CacheRule()], {'a': {'cached_key':
    ...   jnp.ones((1, 2, 1, 4))}})
    >>> t['a']['cached_key'].codes.dtype, used
    (dtype('int8'), [('a/cached_key', 0)])
  """
  used = []

  def one(keys, leaf):
    parts = _parts(keys)
    where = '/'.join(parts)
    for i, r in enumerate(rules):
      if parts and r.matches('/'.join(parts[:-1]), parts[-1]):
        used.append((where, i))
        return kv_cache.store(r, leaf, where)
    return leaf

  out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_stored)
  return out, used


def load_tree(tree: Any) -> Any:
  """The tree as the model reads it (every StoredCache dequantized)."""
  return jax.tree.map(kv_cache.load, tree, is_leaf=_is_stored)


def rules_of(kv: Any, names: tuple[str, ...]) -> tuple[CacheRule, ...]:
  """CacheRules of `kv`: a format name (one rule for `names`), a CacheRule
  or CacheRules.

  Example:
    >>> rules_of('int8', ('k', 'v'))[0].names
    ('k', 'v')
  """
  if kv is None:
    kv = 'none'
  if isinstance(kv, str):
    if kv not in kv_cache.FORMATS:
      raise ValueError(
        f'kv must be one of {kv_cache.FORMATS} or CacheRule(s), got {kv!r}.'
      )
    return (CacheRule(numerics=kv, names=names),)
  rules = (kv,) if isinstance(kv, CacheRule) else tuple(kv)
  if not rules or not all(isinstance(r, CacheRule) for r in rules):
    raise TypeError(
      f'kv must be a format name, a CacheRule or CacheRules, got {kv!r}.'
    )
  return rules


class Decoder(BaseDecoder):
  """Prefill, decode steps and generation of one stock LM and cache rule.

  `generate` (prefill, then a compiled loop of steps; greedy, temperature
  or top-k sampling) is `aqtr.flax.sampling.BaseDecoder`'s.

  Args:
    model: a Hugging Face Flax LM (or its module), a gemma Transformer,
      another linen or nnx LM (then give `vocab=`, `call=`), or a
      `stock_lm.StockLM`; float or served by `aqtr.flax.convert`.
    length: cache slots S (prompt + new tokens), at most the model's
      positions.
    kv: how the cache is stored: a format name ('none', 'int8', 'int4',
      'fp8': one rule for the model's key and value variables), or
      `CacheRule`s (by module path and variable name). Every rule must
      match a cache variable.
    **kwargs: for `stock_lm.adapt` (`vocab=`, `call=`, ...).
  """

  def __init__(self, model: Any, *, length: int, kv: Any = 'none', **kwargs):
    self.lm = stock_lm.adapt(model, **kwargs)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
      raise ValueError(f'length must be an int >= 1, got {length!r}.')
    limit = self.lm.max_length
    if limit is not None and length > limit:
      raise ValueError(
        f'length={length} exceeds the {limit} positions the model has; use '
        'a shorter cache.'
      )
    self.length, self.vocab = length, self.lm.vocab
    self.rules = rules_of(kv, self.lm.names)
    self._extend = jax.jit(self._extend_impl)
    self._checked = False
    self._setup()

  def _variables(self, variables: Any, method: str) -> Any:
    if variables is None and self.lm.variables is not None:
      variables = self.lm.variables()
    if variables is None:
      raise ValueError(
        f"Decoder.{method}: give the model's variables (linen: "
        "{'params': ...} or convert's served variables)."
      )
    return variables

  def _check_rules(self, variables: Any) -> None:
    """One line for a rule that matches no cache variable (once)."""
    if self._checked:
      return
    cache = self.lm.init_cache(variables, 1, self.length)
    used = []

    def probe(c):
      out, hits = store_tree(self.rules, c)
      used.extend(i for _, i in hits)
      return out

    jax.eval_shape(probe, cache)
    names = ['/'.join(_parts(k)) for k, _ in jax.tree.leaves_with_path(cache)]
    for i, r in enumerate(self.rules):
      if i not in used:
        raise ValueError(
          f'Decoder: kv rule {i} ({r}) matched no cache variable; the '
          f'model has {names or "none"}. Fix its path or names.'
        )
    self._checked = True

  def init(self, variables: Any, batch: int) -> Any:
    """The empty cache of `batch` sequences, stored by the rules."""
    variables = self._variables(variables, 'init')
    self._check_rules(variables)
    cache = self.lm.init_cache(variables, batch, self.length)
    return store_tree(self.rules, cache)[0]

  def _call(self, variables, cache, ids, slots, start):
    logits, cache = self.lm.apply(
      variables, load_tree(cache), ids, slots, start
    )
    return logits, store_tree(self.rules, cache)[0]

  def _extend_impl(self, variables, cache, ids, first, start):
    """(logits [b, t, V], cache) of tokens ids [b, t] at slots first.."""
    t = ids.shape[1]
    if self.lm.chunked or t == 1:
      slots = first + jnp.arange(t, dtype=jnp.int32)
      return self._call(variables, cache, ids, slots, start)

    def body(cache, j):
      tok = lax.dynamic_slice_in_dim(ids, j, 1, axis=1)
      lg, cache = self._call(variables, cache, tok, (first + j)[None], start)
      return cache, lg[:, 0]

    cache, logits = lax.scan(body, cache, jnp.arange(t, dtype=jnp.int32))
    return jnp.moveaxis(logits, 0, 1), cache

  def prefill(self, variables: Any, prompts: Any) -> tuple:
    """(logits [b, P, V], cache, start) of prompts (token-id lists)."""
    variables = self._variables(variables, 'prefill')
    ids, start = self._pad(prompts)
    cache = self.init(variables, len(ids))
    logits, cache = self._extend(
      variables, cache, jnp.asarray(ids), jnp.int32(0), jnp.asarray(start)
    )
    return logits, cache, start

  def step(self, variables: Any, tokens: Any, cache: Any, slot: int, start):
    """(logits [b, V], cache) of one new token per sequence at `slot`."""
    variables = self._variables(variables, 'step')
    if not 0 <= slot < self.length:
      raise ValueError(
        f'Decoder.step: slot {slot} is outside the cache [0, {self.length}).'
      )
    ids = step_tokens(tokens, self.vocab)[:, None]
    logits, cache = self._extend(
      variables, cache, ids, jnp.int32(slot), jnp.asarray(start)
    )
    return logits[:, 0], cache

  def _pad(self, prompts):
    ids, start = pad(prompts, self.length, self.vocab)
    if start.any() and not self.lm.padding:
      raise ValueError(
        f'prompts: this {self.lm.kind} model masks no padding, so the '
        'prompts of one batch need one length; decode them in separate '
        'batches.'
      )
    return ids, start

  # The BaseDecoder hooks (generate is BaseDecoder's).

  def _prefill_inputs(self, variables, ids, start) -> tuple:
    return self.init(variables, len(ids)), ids, start

  def _prefill(self, variables, cache, ids, start):
    return self._extend_impl(variables, cache, ids, 0, start)

  def _loop_inputs(self, p, start) -> tuple:
    return jnp.int32(p), start

  def _room(self, cache, i, p, start):
    return p + i - 1 < self.length

  def _next(self, variables, token, cache, i, p, start):
    slot = p + i - 1
    logits, cache = self._call(variables, cache, token[:, None], slot[None],
                               start)  # fmt: skip
    return logits[:, 0], cache

  def _kv_bytes(self, cache) -> int:
    return kv_cache.cache_bytes(cache)
