"""Sampling and prompts shared by aqtr's decoders.

`aqtr.pax.Decoder` (aqtr's own LM) and `aqtr.flax.decode.Decoder` (stock
Flax LMs) pick tokens with `sample` as a `Sampling` says, check and
left-pad prompts with `pad`, and return a `Generation`.

Example:
  >>> ids, start = pad([[1, 2, 3], [4]], length=8, vocab=16)
  >>> ids.tolist(), start.tolist()
  ([[1, 2, 3], [0, 0, 4]], [0, 2])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ['Generation', 'Sampling', 'pad', 'sample']


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How the next token is picked from its logits.

  Attributes:
    temperature: 0 greedy (argmax), else sample softmax(logits / T).
    top_k: sample among the k largest logits only (0: all).
    seed: the PRNG seed of the sampling.
  """

  temperature: float = 0.0
  top_k: int = 0
  seed: int = 0

  def __post_init__(self):
    t = self.temperature
    if not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
      raise ValueError(
        f'Sampling.temperature must be a finite number >= 0, got {t!r}.'
      )
    for name in ('top_k', 'seed'):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f'Sampling.{name} must be an int >= 0, got {v!r}.')


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next tokens [b] (int32) of logits [b, V].

  Example:
    >>> import jax, jax.numpy as jnp
    >>> sample(jnp.array([[0., 3., 1.]]), jax.random.key(0), Sampling())
    Array([1], dtype=int32)
  """
  logits = logits.astype(jnp.float32)
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_k:
    kth = lax.top_k(logits, sampling.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `Decoder.generate` returns.

  Attributes:
    tokens: the new tokens of each prompt.
    stopped: why fewer than max_new tokens came (the cache is full), or
      None.
    compile_s: seconds compiling (0 when compiled by an earlier call).
    prefill_s: seconds of the prefill (and the first token).
    decode_s: seconds of the decode loop (the other tokens).
    kv_bytes: bytes of the cache.
  """

  tokens: list[list[int]]
  stopped: str | None
  compile_s: float
  prefill_s: float
  decode_s: float
  kv_bytes: int

  @property
  def tokens_per_s(self) -> float:
    """Decode-loop throughput: tokens (all sequences) per second."""
    n = sum(len(t) for t in self.tokens) - len(self.tokens)
    return n / self.decode_s if self.decode_s > 0 else float('nan')


def _token_ids(i: int, prompt: Any) -> list[int]:
  if isinstance(prompt, str | bytes):
    raise TypeError(
      f'prompt {i} is text ({prompt!r}); give token ids (tokenize first).'
    )
  arr = np.asarray(prompt)
  if arr.ndim != 1 or (arr.size and arr.dtype.kind not in 'iu'):
    raise TypeError(
      f'prompt {i} must be a flat list of int token ids, got {prompt!r} '
      f'({arr.dtype}, shape {arr.shape}).'
    )
  return [int(t) for t in arr]


def pad(prompts: Any, length: int, vocab: int) -> tuple[np.ndarray, ...]:
  """Left-pads token prompts: (ids [b, P] int32, start [b] int32).

  Raises one line for: no prompts, text or non-integer tokens, an empty
  prompt, a prompt longer than the `length` cache slots, a token outside
  [0, vocab).

  Example:
    >>> ids, start = pad([[1, 2], [3]], length=4, vocab=8)
    >>> ids.tolist(), start.tolist()
    ([[1, 2], [0, 3]], [0, 1])
  """
  if isinstance(prompts, str) or not isinstance(
    prompts, Sequence | np.ndarray | jax.Array
  ):
    raise TypeError(
      'prompts must be a list of token-id lists (tokenize text first), '
      f'got {type(prompts).__name__}.'
    )
  prompts = [_token_ids(i, p) for i, p in enumerate(prompts)]
  if not prompts:
    raise ValueError('prompts: give at least one prompt.')
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f'prompt {i} is empty; give at least one token.')
    if len(p) > length:
      raise ValueError(
        f'prompt {i} has {len(p)} tokens; the cache holds {length} '
        '(shorten the prompt or use a longer cache: length=).'
      )
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
      raise ValueError(
        f'prompt {i}: token {bad[0]} is outside the vocabulary [0, {vocab}).'
      )
  width = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), width), np.int32)
  start = np.zeros(len(prompts), np.int32)
  for i, p in enumerate(prompts):
    ids[i, width - len(p) :] = p
    start[i] = width - len(p)
  return ids, start
