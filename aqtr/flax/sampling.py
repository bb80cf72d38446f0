"""Sampling, prompts and the generation loop shared by aqtr's decoders.

`aqtr.pax.Decoder` (aqtr's own LM) and `aqtr.flax.decode.Decoder` (stock
Flax LMs) pick tokens with `sample` as a `Sampling` says, check and
left-pad prompts with `pad`, and return a `Generation`. Both derive from
`BaseDecoder`, which holds `generate` once: the argument checks, the
compiled prefill and `lax.while_loop` of steps (cached per shapes), the
NaN check and the timing; a decoder only says how its model kind prefills
and steps through its cache.

Example:
  >>> ids, start = pad([[1, 2, 3], [4]], length=8, vocab=16)
  >>> ids.tolist(), start.tolist()
  ([[1, 2, 3], [0, 0, 4]], [0, 2])
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
  'BaseDecoder',
  'Generation',
  'Sampling',
  'pad',
  'sample',
  'step_tokens',
]


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
    number = isinstance(t, int | float) and not isinstance(t, bool)
    if not (number and math.isfinite(t) and t >= 0):
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
  vocab = logits.shape[-1]
  if sampling.top_k > vocab:
    raise ValueError(
      f'Sampling.top_k={sampling.top_k} exceeds the {vocab} logits; use 0 '
      f'(all) or at most {vocab}.'
    )
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
    decode_cpu_s: process CPU seconds (all threads) of the decode loop:
      on a host shared with other jobs steadier than `decode_s`, which
      counts the time the process waited for a core.
  """

  tokens: list[list[int]]
  stopped: str | None
  compile_s: float
  prefill_s: float
  decode_s: float
  kv_bytes: int
  decode_cpu_s: float = float('nan')

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


def step_tokens(
  tokens: Any, vocab: int, method: str = 'step', ndim: int = 1
) -> jax.Array:
  """Token ids of a decode step ([b]) or a prefill ([b, P]) as int32,
  checked (one line each).

  Raises for ids that are not ints of `ndim` axes (a float token used to
  be truncated) or lie outside [0, vocab) (one used to give NaN logits).
  Under a trace only the dtype and shape are checked.

  Args:
    tokens: the ids (a list, NumPy or JAX array).
    vocab: the vocabulary size.
    method: the Decoder method the message names.
    ndim: 1 for a step's tokens, 2 for a prefill's ids.

  Returns:
    The ids as an int32 JAX array.

  Example:
    >>> step_tokens([3, 1], vocab=8).tolist()
    [3, 1]
  """
  where = f'Decoder.{method}: tokens' if ndim == 1 else f'Decoder.{method}: ids'
  want = '[batch]' if ndim == 1 else '[batch, length]'
  arr = tokens if isinstance(tokens, jax.core.Tracer) else np.asarray(tokens)
  if arr.ndim != ndim or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(
      f'{where} must be int token ids of shape {want} (one row per '
      f'sequence), got {arr.dtype} of shape {arr.shape}.'
    )
  if not isinstance(arr, jax.core.Tracer):
    bad = arr[(arr < 0) | (arr >= vocab)]
    if bad.size:
      raise ValueError(
        f'{where}: token {int(bad[0])} is outside the vocabulary [0, {vocab}).'
      )
  return jnp.asarray(tokens, jnp.int32)


def _spec(x: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


class BaseDecoder:
  """`generate` of a decoder: checks, compiled prefill + step loop, timing.

  A subclass (one per model kind: `aqtr.pax.Decoder`, `aqtr.flax.decode.
  Decoder`) sets `length` (cache slots) and `vocab`, calls `_setup()` in
  its `__init__`, and defines:

    _variables(variables, method) -> the checked variables
    _pad(prompts) -> (ids [b, P], start [b]) as numpy int32
    _prefill_inputs(variables, ids, start) -> the prefill's inputs
    _prefill(variables, *inputs) -> (logits [b, P, V], cache) (traced)
    _loop_inputs(p, start) -> the loop's own inputs (p: prompt width)
    _room(cache, i, *loop_inputs) -> whether step i has a slot (traced)
    _next(variables, token, cache, i, *loop_inputs) -> (logits [b, V],
      cache) of token [b] as step i (traced; step 1 follows the prefill)
    _kv_bytes(cache) -> bytes of the cache

  Example (a toy model kind: the next token is the last one + 1):
    >>> import numpy as np
    >>> class Count(BaseDecoder):
    ...   length, vocab = 8, 16
    ...   def __init__(self): self._setup()
    ...   def _variables(self, v, method): return v
    ...   def _pad(self, prompts): return pad(prompts, 8, 16)
    ...   def _prefill_inputs(self, v, ids, start): return (ids,)
    ...   def _prefill(self, v, ids):
    ...     return jax.nn.one_hot(ids + 1, 16), jnp.zeros(())
    ...   def _loop_inputs(self, p, start): return (jnp.int32(p),)
    ...   def _room(self, cache, i, p): return p + i - 1 < self.length
    ...   def _next(self, v, token, cache, i, p):
    ...     return jax.nn.one_hot(token + 1, 16), cache
    ...   def _kv_bytes(self, cache): return 0
    >>> Count().generate({}, [[1, 2]], max_new=3).tokens
    [[3, 4, 5]]
  """

  length: int
  vocab: int

  def _setup(self) -> None:
    """The jitted prefill and loop, and the cache of their compiled forms."""
    self._first = jax.jit(self._first_impl, static_argnames='sampling')
    self._loop = jax.jit(self._loop_impl, static_argnames='sampling')
    self._compiled = {}

  def _first_impl(self, variables, *inputs, sampling):
    """(first token [b], cache, key, whether its logits were finite)."""
    *inputs, key = inputs
    logits, cache = self._prefill(variables, *inputs)
    key, sub = jax.random.split(key)
    ok = jnp.isfinite(logits[:, -1]).all()
    return sample(logits[:, -1], sub, sampling), cache, key, ok

  def _loop_impl(self, variables, token, cache, key, n, *extra, sampling):
    """(tokens [b, S + 1], count, cache, whether every logit was finite)."""
    b = token.shape[0]
    out = jnp.zeros((b, self.length + 1), jnp.int32).at[:, 0].set(token)

    def cond(c):
      i, _, cache, _, _, _ = c
      return (i < n) & self._room(cache, i, *extra)

    def body(c):
      i, token, cache, out, key, ok = c
      logits, cache = self._next(variables, token, cache, i, *extra)
      key, sub = jax.random.split(key)
      token = sample(logits, sub, sampling)
      out = lax.dynamic_update_slice(out, token[:, None], (0, i))
      ok = ok & jnp.isfinite(logits).all()
      return i + 1, token, cache, out, key, ok

    init = (jnp.ones((), jnp.int32), token, cache, out, key, jnp.bool_(True))
    i, _, cache, out, _, ok = lax.while_loop(cond, body, init)
    return out, i, cache, ok

  def _compile(self, args: tuple, extra: tuple, sampling: Sampling) -> tuple:
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
        args[0], token, cache, rng, i32, *map(_spec, extra), sampling=sampling
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
      variables: the model's variables (the stock decoder takes None for
        the model's own: a Hugging Face model with params, an nnx model).
      prompts: token-id lists (different lengths allowed where the model
        masks padding).
      max_new: new tokens per prompt (>= 1); fewer when the cache fills,
        with `Generation.stopped` saying so.
      sampling: greedy by default.

    Returns:
      A `Generation`.

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
    args = (variables, *self._prefill_inputs(variables, ids, start), key)
    extra = self._loop_inputs(p, start)
    t0 = time.perf_counter()
    first, loop = self._compile(args, extra, sampling)
    t1 = time.perf_counter()
    token, cache, key, ok = first(*args)
    token.block_until_ready()
    t2, c2 = time.perf_counter(), time.process_time()
    out, n, cache, ok2 = loop(
      variables, token, cache, key, jnp.int32(n_new), *extra
    )
    out = np.asarray(out)
    t3, c3 = time.perf_counter(), time.process_time()
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
      kv_bytes=self._kv_bytes(cache),
      decode_cpu_s=c3 - c2,
    )
