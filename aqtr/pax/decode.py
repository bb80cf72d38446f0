"""Autoregressive decoding of a `TransformerLm` through a fixed-size cache.

`Decoder(lm, length=S, kv=KVCacheConfig(...))` runs the model's own
layers (`TransformerLm.extend`) under `jit`, with any variables the model
was built for: float training params, or a SERVE model's frozen int8/fp8
weights (`aqtr.train.models.serving_template`).

  prefill   one pass over the left-padded prompts, filling slots 0..P-1
  step      one token per sequence, reading the cache, writing slot index
  generate  prefill, then a `lax.while_loop` of steps (greedy, temperature
            and top-k sampling with a seed); stops when the cache is full
  logits    teacher-forced logits of whole windows through the cache

A batch of prompts of different lengths is left-padded to the longest:
all sequences write each new token at the same slot, sequence i reads
slots start[i]..p, and its positions count from start[i], so every
sequence decodes as it would alone (to float rounding).

Example:
  >>> import fiddle as fdl, jax
  >>> from aqtr.pax import decode, kv_cache, templates
  >>> lm = fdl.build(templates.transformer_lm(
  ...   vocab_size=16, d_model=8, num_layers=1, num_heads=2, hidden_dim=16,
  ...   max_len=8))
  >>> params = lm.init(jax.random.key(0), jax.numpy.zeros((1, 8), int))
  >>> dec = decode.Decoder(lm, kv=kv_cache.KVCacheConfig(numerics='int8'))
  >>> out = dec.generate(params, [[1, 2, 3], [4]], max_new=3)
  >>> [len(t) for t in out.tokens], out.stopped
  ([3, 3], None)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqtr.flax import kinds
from aqtr.flax import sampling as sampling_lib
from aqtr.flax.sampling import (
  BaseDecoder,
  Generation,
  Sampling,
  sample,
  step_tokens,
)
from aqtr.pax import kv_cache
from aqtr.pax.kv_cache import Cache, KVCacheConfig

__all__ = ['Decoder', 'Generation', 'Sampling', 'sample']


def _attentions(lm: nn.Module) -> list[Any]:
  return [layer.attention for layer in lm.layers]


def _vocab(lm: nn.Module) -> int:
  e = lm.embedding
  return getattr(e, 'num_classes', None) or e.num_embeddings


def _check_variables(variables: Any, method: str) -> None:
  """One line unless `variables` is a whole variables dict ('params': ...)."""
  if not isinstance(variables, Mapping) or 'params' not in variables:
    got = (
      f'keys {sorted(map(str, variables))}'
      if isinstance(variables, Mapping)
      else type(variables).__name__
    )
    raise ValueError(
      f"Decoder.{method}: variables must be the model's variables "
      "{'params': ...} as lm.init returns them (not variables['params']), "
      f'got {got}.'
    )


class Decoder(BaseDecoder):
  """Prefill, decode steps and generation of one LM with one cache config.

  `generate` (prefill, then a compiled loop of steps; greedy, temperature
  or top-k sampling) is `aqtr.flax.sampling.BaseDecoder`'s.

  Args:
    lm: a built `aqtr.pax.TransformerLm` (any op configs or modes).
    length: cache slots S (prompt + new tokens); default and at most
      `lm.max_len` (the learned positions).
    kv: how the cache stores keys and values.
  """

  def __init__(
    self,
    lm: nn.Module,
    *,
    length: int | None = None,
    kv: KVCacheConfig | None = None,
  ):
    if not (
      kinds.is_linen(lm)
      and hasattr(type(lm), 'extend')
      and 'max_len' in {f.name for f in dataclasses.fields(lm)}
    ):
      raise TypeError(
        'Decoder: lm must be a built aqtr.pax.TransformerLm (e.g. '
        'fdl.build(aqtr.pax.templates.transformer_lm(...))), got '
        f'{type(lm).__name__}.'
      )
    kv = KVCacheConfig() if kv is None else kv
    if not isinstance(kv, KVCacheConfig):
      raise ValueError(f'kv must be a KVCacheConfig, got {kv!r}.')
    length = lm.max_len if length is None else length
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
      raise ValueError(f'length must be an int >= 1, got {length!r}.')
    if length > lm.max_len:
      raise ValueError(
        f"length={length} exceeds the model's max_len={lm.max_len} "
        '(its learned positions); use a shorter cache.'
      )
    self.lm, self.length, self.kv = lm, length, kv
    self.vocab = _vocab(lm)
    self.init(1, np.zeros(1, np.int32))  # Checks the cache shape early.
    extend = functools.partial(lm.apply, method='extend')
    self._extend = jax.jit(lambda v, ids, c: extend(v, ids, c, kv))
    self._setup()

  def init(self, batch: int, start: Any) -> Cache:
    """An empty cache for `batch` sequences starting at slots `start`."""
    layers = []
    for att in _attentions(self.lm):
      inner = att.q_proj.features
      layers.append(
        kv_cache.init_layer(
          self.kv,
          batch=batch,
          length=self.length,
          num_heads=att.num_heads,
          head_dim=inner // att.num_heads,
        )
      )
    return Cache(
      tuple(layers), jnp.zeros((), jnp.int32), jnp.asarray(start, jnp.int32)
    )

  def pad(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    """Left-pads token prompts: (ids [b, P] int32, start [b] int32).

    Raises:
      ValueError: no prompt, an empty prompt, a prompt longer than the
        cache, or a token outside the vocabulary.
    """
    return sampling_lib.pad(prompts, self.length, self.vocab)

  def prefill(self, variables: Any, ids: Any, start: Any) -> tuple:
    """(logits [b, P, V], cache) of left-padded prompts (see `pad`)."""
    _check_variables(variables, 'prefill')
    ids = step_tokens(ids, self.vocab, 'prefill', ndim=2)
    cache = self.init(len(ids), start)
    return self._extend(variables, ids, cache)

  def step(self, variables: Any, tokens: Any, cache: Cache) -> tuple:
    """(logits [b, V], cache) of one new token per sequence."""
    _check_variables(variables, 'step')
    if not isinstance(cache, Cache):
      raise TypeError(
        'Decoder.step: cache must be the Cache that prefill or step '
        f'returned (or Decoder.init(batch, start)), got {cache!r}.'
      )
    if not isinstance(cache.index, jax.core.Tracer):
      if int(cache.index) >= self.length:
        raise ValueError(
          f'Decoder.step: the cache is full ({self.length} slots); a step '
          'would overwrite its last slot. Use a longer cache (length=).'
        )
    ids = step_tokens(tokens, self.vocab)[:, None]
    logits, cache = self._extend(variables, ids, cache)
    return logits[:, 0], cache

  def logits(self, variables: Any, ids: Any) -> jax.Array:
    """Teacher-forced logits [b, T, V] of windows `ids` through the cache.

    Every query reads the keys and values as the cache stores them.
    """
    return self.prefill(variables, ids, np.zeros(len(ids), np.int32))[0]

  # The BaseDecoder hooks (generate is BaseDecoder's).

  def _variables(self, variables: Any, method: str) -> Any:
    _check_variables(variables, method)
    return variables

  def _pad(self, prompts):
    return self.pad(prompts)

  def _prefill_inputs(self, variables, ids, start) -> tuple:
    return ids, start

  def _prefill(self, variables, ids, start):
    cache = self.init(ids.shape[0], start)
    return self.lm.apply(variables, ids, cache, self.kv, method='extend')

  def _loop_inputs(self, p, start) -> tuple:
    return ()

  def _room(self, cache, i):
    return cache.index < self.length

  def _next(self, variables, token, cache, i):
    logits, cache = self.lm.apply(
      variables, token[:, None], cache, self.kv, method='extend'
    )
    return logits[:, 0], cache

  def _kv_bytes(self, cache) -> int:
    return kv_cache.nbytes(cache.layers)
