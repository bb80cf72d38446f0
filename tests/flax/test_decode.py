"""The stock-model decoder (`aqtr.flax.decode`): a stock LM's own cache,
stored by rule, with float or converted weights, and its bad input."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from test_kv_cache import HEAD, HEADS, LEN, LM, Attention, NnxLM

import aqtr.flax
from aqtr.flax import stock_lm
from aqtr.flax.decode import Decoder, Sampling, pad, store_tree
from aqtr.flax.kv_cache import CacheRule, StoredCache, cache_bytes
from aqtr.flax.sampling import sample
from aqtr.rules import Rule

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope='module')
def lm():
  model = LM()
  zeros = jnp.zeros((1, LEN), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), zeros, zeros)['params']
  return model, {'params': params}


def _own_greedy(model, variables, prompt, steps):
  """The model's own loop (init_cache, prefill, one token a step)."""
  zeros = jnp.zeros((1, LEN), jnp.int32)
  cache = model.init(jax.random.key(1), zeros, zeros, init_cache=True)
  cache = jax.tree.map(jnp.zeros_like, cache['cache'])
  ids, pos = jnp.asarray([prompt]), jnp.arange(len(prompt))[None]
  tokens, logits = [], []
  step = jax.jit(
    lambda c, ids, pos: model.apply(
      {**variables, 'cache': c}, ids, pos, mutable=['cache']
    )
  )
  for _ in range(steps):
    lg, new = step(cache, ids, pos)
    cache = new['cache']
    logits.append(lg[0, -1])
    tokens.append(int(jnp.argmax(lg[0, -1])))
    ids, pos = jnp.asarray([[tokens[-1]]]), pos[:, -1:] + 1
  return tokens, jnp.stack(logits)


def _decoder_logits(dec, variables, prompt, steps):
  """Greedy through Decoder.prefill and Decoder.step (logits too)."""
  logits, cache, start = dec.prefill(variables, [prompt])
  out, lgs = [], [logits[0, -1]]
  tok = int(jnp.argmax(logits[0, -1]))
  for i in range(steps - 1):
    out.append(tok)
    lg, cache = dec.step(variables, [tok], cache, len(prompt) + i, start)
    lgs.append(lg[0])
    tok = int(jnp.argmax(lg[0]))
  return [*out, tok], jnp.stack(lgs), cache


def test_a_float_cache_decodes_as_the_models_own_loop_bit_for_bit(lm):
  model, variables = lm
  tokens, logits = _own_greedy(model, variables, PROMPT, 6)
  dec = Decoder(model, length=LEN, vocab=32)
  got, glogits, _ = _decoder_logits(dec, variables, PROMPT, 6)
  assert got == tokens
  np.testing.assert_array_equal(glogits, logits)
  assert dec.generate(variables, [PROMPT], 6).tokens == [tokens]


@pytest.mark.parametrize('kv, ratio', [('int8', 0.3), ('int4', 0.17)])
def test_quantized_caches_are_stored_and_decode_close(lm, kv, ratio):
  model, variables = lm
  _, logits = _own_greedy(model, variables, PROMPT, 4)
  dec = Decoder(model, length=LEN, kv=kv, vocab=32)
  _, qlogits, cache = _decoder_logits(dec, variables, PROMPT, 4)
  assert isinstance(cache['h_0']['cached_key'], StoredCache)
  f = Decoder(model, length=LEN, vocab=32).init(variables, 1)
  assert cache_bytes(cache) / cache_bytes(f) <= ratio
  err = float(jnp.max(jnp.abs(qlogits - logits)) / jnp.max(jnp.abs(logits)))
  assert 0 < err < {'int8': 0.02, 'int4': 0.3}[kv], err


class HfAttention(nn.Module):
  """As Hugging Face Flax attention: a cache only with init_cache or one."""

  @nn.compact
  def __call__(self, x, init_cache: bool = False):
    t = x.shape[1]
    q, k, v = (nn.DenseGeneral((HEADS, HEAD), name=n)(x) for n in 'qkv')
    queries = jnp.arange(t)
    if self.has_variable('cache', 'cached_key') or init_cache:
      decoding = self.has_variable('cache', 'cached_key')
      ck = self.variable('cache', 'cached_key', jnp.zeros, k.shape, k.dtype)
      cv = self.variable('cache', 'cached_value', jnp.zeros, v.shape, v.dtype)
      ci = self.variable('cache', 'cache_index', lambda: jnp.array(0))
      if decoding:
        i = ci.value
        ck.value = lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
        cv.value = lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
        ci.value = i + t
        k, v, queries = ck.value, cv.value, i + queries
    mask = jnp.arange(k.shape[1])[None] <= queries[:, None]
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) / math.sqrt(HEAD)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name='o')(out)


class HfLM(nn.Module):
  @nn.compact
  def __call__(self, ids, positions, init_cache: bool = False):
    d = HEADS * HEAD
    x = nn.Embed(32, d)(ids) + nn.Embed(LEN, d)(positions)
    for i in range(2):
      x = x + HfAttention(name=f'h_{i}')(nn.LayerNorm()(x), init_cache)
    return nn.Dense(32)(nn.LayerNorm()(x))


@pytest.mark.slow  # (docs/decoding.md runs an nnx case by default)
def test_converted_weights_decode_the_training_models_greedy_tokens():
  model = HfLM()
  zeros = jnp.zeros((1, LEN), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), zeros, zeros)
  q = aqtr.flax.quantize(model, [Rule('int8', path='h_.*')])
  served, svars = aqtr.flax.convert(q, zeros, zeros, variables=variables)
  kernel = svars['params']['h_0']['q']['kernel']
  assert 'int8' in str(jax.tree.map(lambda x: x.dtype, kernel))
  want = Decoder(q, length=LEN, vocab=32).generate(variables, [PROMPT], 8)
  got = Decoder(served, length=LEN, vocab=32).generate(svars, [PROMPT], 8)
  assert got.tokens == want.tokens
  int8 = Decoder(served, length=LEN, kv='int8', vocab=32)
  assert len(int8.generate(svars, [PROMPT], 8).tokens[0]) == 8


def test_sampling_is_seeded_and_top_k_1_is_greedy(lm):
  model, variables = lm
  dec = Decoder(model, length=LEN, kv='int8', vocab=32)
  greedy = dec.generate(variables, [PROMPT], 6).tokens
  one = dec.generate(variables, [PROMPT], 6, Sampling(temperature=2, top_k=1))
  assert one.tokens == greedy
  hot = Sampling(temperature=5.0, seed=3)
  a, b = (dec.generate(variables, [PROMPT], 8, hot).tokens for _ in 'ab')
  assert a == b
  assert (
    dec.generate(variables, [PROMPT], 8, Sampling(temperature=5.0)).tokens != a
  )


def test_a_full_cache_stops_generation_with_a_note(lm):
  model, variables = lm
  dec = Decoder(model, length=LEN, vocab=32)
  out = dec.generate(variables, [[1] * 14], max_new=10)
  assert len(out.tokens[0]) == 3 and 'cache is full' in out.stopped


def _nnx_own(model, prompt, steps):
  toks, logits = list(prompt), []
  for p in range(len(prompt) + steps - 1):
    lg = model(jnp.asarray([[toks[p]]]), jnp.asarray([[p]]))
    if p >= len(prompt) - 1:
      logits.append(lg[0, -1])
      toks.append(int(jnp.argmax(lg[0, -1])))
  return toks[len(prompt) :], jnp.stack(logits)


@pytest.mark.slow  # (docs/decoding.md runs an nnx case by default)
def test_nnx_models_decode_with_their_nnx_caches():
  own = NnxLM(nnx.Rngs(0))
  for layer in own.layers:
    layer.init_cache((1, LEN, layer.in_features))
  tokens, _ = _nnx_own(own, PROMPT, 5)
  model = NnxLM(nnx.Rngs(0))
  dec = Decoder(model, length=LEN, vocab=32)
  assert dec.generate(None, [PROMPT], 5).tokens == [tokens]
  int8 = Decoder(model, length=LEN, kv='int8', vocab=32).generate(
    None, [PROMPT], 5
  )
  assert int8.kv_bytes / dec.generate(None, [PROMPT], 1).kv_bytes <= 0.3
  q = aqtr.flax.quantize(NnxLM(nnx.Rngs(0)), [Rule('int8', path='layers.*')])
  sample = jnp.zeros((1, 1), jnp.int32)
  stock_lm.nnx_lm(q, vocab=32)  # makes its caches (1 slot)
  want = Decoder(q, length=LEN, vocab=32).generate(None, [PROMPT], 5)
  served = aqtr.flax.convert(q, sample, sample)
  got = Decoder(served, length=LEN, vocab=32).generate(None, [PROMPT], 5)
  assert got.tokens == want.tokens


def test_store_tree_matches_rules_by_path_and_name():
  tree = {'a': {'cached_key': jnp.ones((1, 2, 1, 4)), 'cache_index': 0}}
  out, used = store_tree([CacheRule(path='b'), CacheRule()], tree)
  assert used == [('a/cached_key', 1)] and out['a']['cache_index'] == 0


# Bad input: one line each, naming the argument.
@pytest.mark.parametrize(
  'prompts, msg',
  [
    ([[1] * (LEN + 1)], 'prompt 0 has 17 tokens; the cache holds 16'),
    ([[1], []], 'prompt 1 is empty'),
    ([], 'give at least one prompt'),
    ([[1, 32]], r'token 32 is outside the vocabulary \[0, 32\)'),
    ([[1, -1]], 'token -1 is outside the vocabulary'),
    ([[1.5, 2.0]], 'must be a flat list of int token ids'),
    (['hello'], 'prompt 0 is text'),
    ('hello', 'prompts must be a list of token-id lists'),
  ],
)
def test_bad_prompts_are_one_line(prompts, msg):
  with pytest.raises((ValueError, TypeError), match=msg):
    pad(prompts, LEN, 32)


@pytest.mark.parametrize(
  'kw, msg',
  [
    ({'temperature': -1.0}, 'temperature must be a finite number >= 0'),
    ({'temperature': float('nan')}, 'temperature must be a finite number'),
    ({'temperature': float('inf')}, 'temperature must be a finite number'),
    ({'temperature': True}, 'temperature must be a finite number'),
    ({'top_k': -2}, 'top_k must be an int >= 0'),
  ],
)
def test_bad_sampling_is_one_line(kw, msg):
  with pytest.raises(ValueError, match=msg):
    Sampling(**kw)


def test_sample_names_a_top_k_beyond_the_vocabulary():
  logits = jnp.zeros((2, 8))
  with pytest.raises(ValueError, match=r'top_k=9 exceeds the 8 logits'):
    sample(logits, jax.random.key(0), Sampling(temperature=1, top_k=9))
  got = sample(logits, jax.random.key(0), Sampling(temperature=1, top_k=8))
  assert got.shape == (2,)


def test_an_nnx_cache_rule_matching_no_variable_is_one_line():
  rule = CacheRule(path='decoder/.*')
  dec = Decoder(NnxLM(nnx.Rngs(0)), length=LEN, kv=rule, vocab=32)
  with pytest.raises(ValueError, match=r'kv rule 0 .* matched no cache var.*'
                     r'Fix its path or names'):  # fmt: skip
    dec.generate(None, [PROMPT], 2)


def test_bad_decoder_arguments_are_one_line(lm):
  model, variables = lm
  dec = Decoder(model, length=LEN, vocab=32)
  with pytest.raises(ValueError, match='top_k=33 exceeds the vocabulary'):
    dec.generate(variables, [PROMPT], 2, Sampling(temperature=1, top_k=33))
  with pytest.raises(ValueError, match='max_new must be an int >= 1'):
    dec.generate(variables, [PROMPT], 0)
  with pytest.raises(ValueError, match='masks no padding'):
    dec.generate(variables, [PROMPT, [1]], 2)
  with pytest.raises(ValueError, match='length must be an int >= 1'):
    Decoder(model, length=0, vocab=32)
  with pytest.raises(ValueError, match="kv must be one of .*'int3'"):
    Decoder(model, length=LEN, kv='int3', vocab=32)
  with pytest.raises(TypeError, match='give vocab='):
    Decoder(model, length=LEN)
  bad = Decoder(model, length=LEN, kv=CacheRule(path='decoder/.*'), vocab=32)
  with pytest.raises(ValueError, match='kv rule 0 .* matched no cache var'):
    bad.generate(variables, [PROMPT], 2)


def test_step_tokens_are_checked(lm):
  model, variables = lm
  dec = Decoder(model, length=LEN, vocab=32)
  _, cache, start = dec.prefill(variables, [PROMPT])
  with pytest.raises(TypeError, match='step: tokens must be int token ids'):
    dec.step(variables, [2.5], cache, len(PROMPT), start)
  with pytest.raises(ValueError, match=r'token 32 is outside the vocab'):
    dec.step(variables, [32], cache, len(PROMPT), start)


class _OddHeadLM(nn.Module):
  @nn.compact
  def __call__(self, ids, positions, init_cache: bool = False):
    x = nn.Embed(32, 5)(ids)
    x = x + Attention(heads=1, head=5, name='h_0')(x, init_cache)
    return nn.Dense(32)(x)


def test_packed_int4_cache_of_an_odd_head_size_is_one_line():
  model, zeros = _OddHeadLM(), jnp.zeros((1, LEN), jnp.int32)
  variables = {'params': model.init(jax.random.key(0), zeros, zeros)['params']}
  dec = Decoder(model, length=LEN, kv='int4', vocab=32)
  with pytest.raises(ValueError, match=r'h_0/cached_key has head size 5 \(od'):
    dec.generate(variables, [PROMPT], 2)


def test_nan_weights_do_not_silently_decode_token_0(lm):
  model, variables = lm
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), variables)
  dec = Decoder(model, length=LEN, vocab=32)
  with pytest.raises(ValueError, match='non-finite logits .*NaN or inf w'):
    dec.generate(nan, [PROMPT], 3)
