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

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.flax import kv_cache, stock_lm
from aqtr.flax.kv_cache import CacheRule, StoredCache
from aqtr.flax.sampling import Generation, Sampling, pad, sample

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


class Decoder:
  """Prefill, decode steps and generation of one stock LM and cache rule.

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
    self._first = jax.jit(self._first_impl, static_argnames='sampling')
    self._loop = jax.jit(self._loop_impl, static_argnames='sampling')
    self._checked = False
    self._compiled = {}

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
    ids = jnp.asarray(tokens, jnp.int32)[:, None]
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

  def _first_impl(self, variables, cache, ids, start, key, *, sampling):
    logits, cache = self._extend_impl(variables, cache, ids, 0, start)
    key, sub = jax.random.split(key)
    ok = jnp.isfinite(logits[:, -1]).all()
    return sample(logits[:, -1], sub, sampling), cache, key, ok

  def _loop_impl(self, variables, token, cache, key, p, start, n, *, sampling):
    """(tokens [b, S + 1], count, cache, whether every logit was finite)."""
    b = token.shape[0]
    out = jnp.zeros((b, self.length + 1), jnp.int32).at[:, 0].set(token)

    def cond(c):
      i = c[0]
      return (i < n) & (p + i - 1 < self.length)

    def body(c):
      i, token, cache, out, key, ok = c
      slot = p + i - 1
      logits, cache = self._call(variables, cache, token[:, None], slot[None],
                                 start)  # fmt: skip
      key, sub = jax.random.split(key)
      token = sample(logits[:, 0], sub, sampling)
      out = lax.dynamic_update_slice(out, token[:, None], (0, i))
      ok = ok & jnp.isfinite(logits[:, 0]).all()
      return i + 1, token, cache, out, key, ok

    init = (jnp.ones((), jnp.int32), token, cache, out, key, jnp.bool_(True))
    i, _, cache, out, _, ok = lax.while_loop(cond, body, init)
    return out, i, cache, ok

  def _compile(self, args: tuple, sampling: Sampling) -> tuple:
    """The compiled prefill and loop for these shapes (cached)."""
    leaves, treedef = jax.tree.flatten(args)
    spec = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
    key = (spec, treedef, sampling)  # (no repr: nnx states may hold
    try:  # frozen kernels that refuse to be read as values)
      hash(key)
    except TypeError:  # Unhashable static metadata: compile anew.
      key = object()
    if key not in self._compiled:
      lowered = self._first.lower(*args, sampling=sampling)
      token, cache, rng, _ = lowered.out_info
      i32 = jax.ShapeDtypeStruct((), jnp.int32)
      loop = self._loop.lower(
        args[0], token, cache, rng, i32, args[3], i32, sampling=sampling
      )
      self._compiled[key] = (lowered.compile(), loop.compile())
    return self._compiled[key]

  def generate(
    self,
    variables: Any,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    sampling: Sampling | None = None,
  ) -> Generation:
    """New tokens of each prompt: prefill, then decode steps in a loop.

    Args:
      variables: the model's variables (None: the model's own, for a
        Hugging Face model with params or an nnx model).
      prompts: token-id lists (different lengths when the model masks
        padding).
      max_new: new tokens per prompt (>= 1); fewer when the cache fills,
        with `Generation.stopped` saying so.
      sampling: greedy by default.

    Returns:
      An `aqtr.flax.sampling.Generation`.

    Raises:
      ValueError: one line for bad prompts or arguments, and when the
        model computes NaN or inf logits (NaN weights).
    """
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
      raise TypeError(f'sampling must be a Sampling, got {sampling!r}.')
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
      raise ValueError(f'max_new must be an int >= 1, got {max_new!r}.')
    if sampling.top_k > self.vocab:
      raise ValueError(
        f'Sampling.top_k={sampling.top_k} exceeds the vocabulary size '
        f'{self.vocab}; use 0 (all) or at most {self.vocab}.'
      )
    variables = self._variables(variables, 'generate')
    ids, start = self._pad(prompts)
    p = ids.shape[1]
    room = self.length - p + 1
    n_new, stopped = max_new, None
    if max_new > room:
      n_new = room
      stopped = (
        f'the cache is full ({self.length} slots) after {room} new token(s) '
        f'of the {max_new} asked; generation stopped.'
      )
    key = jax.random.key(sampling.seed)
    sampling = dataclasses.replace(sampling, seed=0)  # Static: one compile.
    ids, start = jnp.asarray(ids), jnp.asarray(start)
    cache = self.init(variables, len(ids))
    args = (variables, cache, ids, start, key)
    t0 = time.perf_counter()
    first, loop = self._compile(args, sampling)
    t1 = time.perf_counter()
    token, cache, key, ok = first(*args)
    token.block_until_ready()
    t2 = time.perf_counter()
    out, n, cache, ok2 = loop(
      variables, token, cache, key, jnp.int32(p), start, jnp.int32(n_new)
    )
    out = np.asarray(out)
    t3 = time.perf_counter()
    if not (bool(ok) and bool(ok2)):
      raise ValueError(
        'Decoder.generate: the model computed non-finite logits (NaN or '
        'inf), so the tokens would be meaningless; check the variables '
        '(NaN or inf weights?).'
      )
    n = int(n)
    return Generation(
      tokens=[row[:n].tolist() for row in out],
      stopped=stopped,
      compile_s=t1 - t0,
      prefill_s=t2 - t1,
      decode_s=t3 - t2,
      kv_bytes=kv_cache.cache_bytes(cache),
    )
