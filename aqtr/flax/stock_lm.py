"""How `aqtr.flax.decode.Decoder` calls a stock LM with its own cache.

A `StockLM` names the few things a decoding loop needs from a model: its
vocabulary size, how to make its empty cache for `batch` sequences of
`length` slots, and how to run it on a chunk of tokens through that cache.
The cache is the model's own (a linen `'cache'` collection, `nnx.Cache`
variables, gemma's explicit cache dict), and the model's own code runs
unmodified. Makers for the common kinds:

  hf      a Hugging Face Flax causal LM (`FlaxGPT2LMHeadModel`,
          `FlaxLlamaForCausalLM`, ... or its linen `module`, float or
          converted by `aqtr.flax.convert`): 'cache' collection with
          `cached_key`, `cached_value` [b, S, n, h], `cache_index`.
  gemma   DeepMind gemma's `transformer.Transformer` (explicit cache
          {'layer_i': {'k', 'v', 'end_index'}}).
  linen   any linen LM keeping a 'cache' collection (Hugging Face style:
          created by a call with `init_cache=True`).
  nnx_lm  an nnx LM with `nnx.Cache` variables (e.g. of
          `nnx.MultiHeadAttention(decode=True)`).

`adapt(model)` picks one for a model (or takes a StockLM as it is).

The decoder writes every chunk at the same slots for all sequences (left-
padded prompts): `apply(variables, cache, ids, slots, start)` gets the
chunk's tokens [b, t], their cache slots [t] and each sequence's first
real slot start [b], and makes the model's positions and masks from them.

Example:
  >>> import flax.linen as nn
  >>> lm = linen(nn.Dense(4), vocab=4)  # (no cache: not decodable)
  >>> lm.kind, lm.vocab
  ('linen', 4)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.flax import kinds

__all__ = ['StockLM', 'adapt', 'gemma', 'hf', 'linen', 'nnx_lm']


@dataclasses.dataclass(frozen=True, kw_only=True)
class StockLM:
  """One stock LM as the decoder calls it.

  Attributes:
    kind: 'hf', 'gemma', 'linen' or 'nnx' (for messages).
    vocab: the vocabulary size (logits' last axis).
    init_cache: (variables, batch, length) -> the model's empty float
      cache (a pytree of arrays).
    apply: (variables, cache, ids [b, t], slots [t], start [b]) ->
      (logits [b, t, V], the cache the model left).
    names: the cache variables holding keys and values (what a
      `CacheRule` made from a format name matches).
    chunked: the model takes several tokens per call (else the prefill
      feeds the prompt one token a call).
    padding: the model masks slots before `start` (prompts of different
      lengths may share a batch).
    max_length: the most cache slots the model has positions for (None:
      no bound).
    variables: () -> the variables used when none are given (a Hugging
      Face model's params, an nnx model's state less its caches, read at
      each call), or None.
  """

  kind: str
  vocab: int
  init_cache: Callable[..., Any]
  apply: Callable[..., tuple[jax.Array, Any]]
  names: tuple[str, ...] = ('cached_key', 'cached_value')
  chunked: bool = True
  padding: bool = True
  max_length: int | None = None
  variables: Callable[[], Any] | None = None


def _zeros(tree: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _positions(slots, start):
  """Positions counted from each sequence's first real slot (>= 0)."""
  return jnp.maximum(slots[None, :] - start[:, None], 0)


def _valid(length, start):
  """[b, S] int32: 1 at the slots a sequence owns (from its start)."""
  return (jnp.arange(length)[None, :] >= start[:, None]).astype(jnp.int32)


def _is_hf_module(module: Any) -> bool:
  return type(module).__module__.startswith('transformers.') or any(
    c.__module__.startswith('transformers.') for c in type(module).__mro__
  )


def hf(model: Any) -> StockLM:
  """A Hugging Face Flax causal LM (the model or its linen `module`).

  Args:
    model: e.g. `FlaxGPT2LMHeadModel(config)` (its params become the
      default variables), its `.module`, or the module a
      `aqtr.flax.convert` served (pass the served variables to the
      decoder).

  Returns:
    A StockLM.
  """
  module = getattr(model, 'module', model)
  if not kinds.is_linen(module) or not _is_hf_module(module):
    raise TypeError(
      'stock_lm.hf: model must be a Hugging Face Flax LM or its linen '
      f'module, got {type(model).__name__}.'
    )
  config = module.config
  has_params = (
    module is not model and getattr(model, '_params', None) is not None
  )
  limit = getattr(config, 'max_position_embeddings', None) or getattr(
    config, 'n_positions', None
  )
  call = inspect.signature(type(module).__call__).parameters
  with_positions = 'position_ids' in call

  def kwargs(mask, positions):
    kw = {'attention_mask': mask, 'return_dict': False}
    if with_positions:
      kw['position_ids'] = positions
    return kw

  def init_cache(variables, batch, length):
    ids = jnp.ones((batch, length), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(length), ids.shape)

    def fn(v):
      _, new = module.apply(
        v, ids, init_cache=True, mutable=['cache'], **kwargs(ids, pos)
      )
      return new['cache']

    return _zeros(jax.eval_shape(fn, variables))

  def apply(variables, cache, ids, slots, start):
    length = next(x.shape[1] for x in jax.tree.leaves(cache) if x.ndim > 1)
    mask, pos = _valid(length, start), _positions(slots, start)
    out, new = module.apply(
      {**variables, 'cache': cache},
      ids,
      mutable=['cache'],
      **kwargs(mask, pos),
    )
    return out[0], new['cache']

  return StockLM(
    kind='hf',
    vocab=config.vocab_size,
    init_cache=init_cache,
    apply=apply,
    max_length=limit,
    variables=(lambda: {'params': model.params}) if has_params else None,
  )


def gemma(transformer: nn.Module, dtype: Any = jnp.float32) -> StockLM:
  """DeepMind gemma's `Transformer` (float, or served by `convert`).

  Positions are the cache slots (gemma's sliding-window masks count in
  slots; RoPE depends on position differences only), and the mask hides
  each sequence's left padding.

  Args:
    transformer: a `gemma.transformer.Transformer`.
    dtype: the cache's float dtype.

  Returns:
    A StockLM (cache variables 'k' and 'v').
  """
  config = getattr(transformer, 'config', None)
  if not hasattr(config, 'init_cache') or not hasattr(config, 'num_embed'):
    raise TypeError(
      'stock_lm.gemma: transformer must be a gemma.transformer.Transformer, '
      f'got {type(transformer).__name__}.'
    )

  def init_cache(variables, batch, length):
    del variables
    return config.init_cache(batch, dtype=dtype, cache_length=length)

  def apply(variables, cache, ids, slots, start):
    b, length = ids.shape[0], cache['layer_0']['k'].shape[1]
    s = jnp.arange(length)
    mask = (s[None, None, :] >= start[:, None, None]) & (
      s[None, None, :] <= slots[None, :, None]
    )
    pos = jnp.broadcast_to(slots, (b, slots.shape[0]))
    return transformer.apply(variables, ids, pos, dict(cache), mask)

  return StockLM(
    kind='gemma',
    vocab=config.num_embed,
    init_cache=init_cache,
    apply=apply,
    names=('k', 'v'),
  )


def linen(
  model: nn.Module,
  *,
  vocab: int,
  call: Callable[..., Any] | None = None,
  max_length: int | None = None,
) -> StockLM:
  """A linen LM with a Hugging Face style 'cache' collection.

  Args:
    model: the (unbound) linen module.
    vocab: its vocabulary size.
    call: (model, variables, ids, positions, mutable, **kw) -> model
      output, as `model.apply(variables, ids, positions, mutable=mutable,
      **kw)` (the default); `kw` is `{'init_cache': True}` when the cache
      is made. The output is the logits, or a tuple whose first item is.
    max_length: the most slots its positions allow.

  Returns:
    A StockLM whose prompts in one batch have one length (the default
    call passes no padding mask).
  """
  if not kinds.is_linen(model):
    raise TypeError(
      f'stock_lm.linen: model must be a linen Module, got {type(model)}.'
    )
  if call is None:

    def call(m, variables, ids, positions, mutable, **kw):
      return m.apply(variables, ids, positions, mutable=mutable, **kw)

  def init_cache(variables, batch, length):
    ids = jnp.zeros((batch, length), jnp.int32)

    def fn(v):
      return call(model, v, ids, ids, ['cache'], init_cache=True)[1]['cache']

    return _zeros(jax.eval_shape(fn, variables))

  def apply(variables, cache, ids, slots, start):
    out, new = call(
      model,
      {**variables, 'cache': cache},
      ids,
      _positions(slots, start),
      ['cache'],
    )
    return (out[0] if isinstance(out, tuple) else out), new['cache']

  return StockLM(
    kind='linen',
    vocab=vocab,
    init_cache=init_cache,
    apply=apply,
    padding=False,
    max_length=max_length,
  )


def _init_attention_caches(model: nnx.Module, batch: int, length: int):
  """`init_cache` of every `nnx.MultiHeadAttention` in the model."""
  found = False
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.MultiHeadAttention):
      node.init_cache((batch, length, node.in_features), jnp.float32)
      found = True
  if not found:
    raise ValueError(
      'stock_lm.nnx_lm: the model has no nnx.MultiHeadAttention; pass '
      'init_cache=(model, batch, length) -> None that makes its caches.'
    )


def nnx_lm(
  model: nnx.Module,
  *,
  vocab: int,
  call: Callable[..., jax.Array] | None = None,
  init_cache: Callable[..., None] | None = None,
  chunked: bool = False,
) -> StockLM:
  """An nnx LM keeping `nnx.Cache` variables (its state is the variables).

  Args:
    model: the nnx Module (float, or served by `aqtr.flax.convert`).
    vocab: its vocabulary size.
    call: (model, ids [b, t], positions [b, t]) -> logits [b, t, V];
      default `model(ids, positions)`.
    init_cache: (model, batch, length) -> None, making the caches in
      place; default: `init_cache` of every `nnx.MultiHeadAttention`.
    chunked: the model takes several tokens a call (nnx attention in
      decode mode takes one).

  Returns:
    A StockLM; its variables default to the model's state less caches.
  """
  if not kinds.is_nnx(model):
    raise TypeError(
      f'stock_lm.nnx_lm: model must be an nnx Module, got {type(model)}.'
    )
  call = call or (lambda m, ids, positions: m(ids, positions))
  make = init_cache or _init_attention_caches
  make(model, 1, 1)
  graphdef = nnx.split(model, nnx.Cache, ...)[0]

  def init_cache_fn(variables, batch, length):
    del variables
    make(model, batch, length)
    return nnx.split(model, nnx.Cache, ...)[1]

  def apply(variables, cache, ids, slots, start):
    m = nnx.merge(graphdef, cache, variables)
    logits = call(m, ids, _positions(slots, start))
    return logits, nnx.split(m, nnx.Cache, ...)[1]

  return StockLM(
    kind='nnx',
    vocab=vocab,
    init_cache=init_cache_fn,
    apply=apply,
    chunked=chunked,
    padding=False,
    variables=lambda: nnx.split(model, nnx.Cache, ...)[2],
  )


def adapt(model: Any, **kwargs) -> StockLM:
  """The StockLM of a model: a StockLM as it is, else by its kind.

  Hugging Face Flax LMs and gemma Transformers need no kwargs; other
  linen and nnx models need `vocab=` (and optionally `call=`).
  """
  if isinstance(model, StockLM):
    return model
  module = getattr(model, 'module', model)
  if kinds.is_linen(module) and _is_hf_module(module):
    return hf(model)
  config = getattr(model, 'config', None)
  if kinds.is_linen(model) and hasattr(config, 'num_embed'):
    return gemma(model, **kwargs)
  if 'vocab' not in kwargs and kinds.name(model) is not None:
    raise TypeError(
      f'Decoder: a {type(model).__name__} is neither a Hugging Face Flax LM '
      'nor a gemma Transformer; give vocab= (and call= if it is not '
      'called as model(ids, positions)), or a stock_lm.StockLM.'
    )
  if kinds.is_linen(model):
    return linen(model, **kwargs)
  if kinds.is_nnx(model):
    return nnx_lm(model, **kwargs)
  raise TypeError(
    'Decoder: model must be a Flax LM (linen or nnx, a Hugging Face Flax '
    f'LM, a gemma Transformer) or a stock_lm.StockLM, got {type(model)}.'
  )
