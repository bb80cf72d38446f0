"""KV caches by rule (`aqtr.flax.kv_cache`): stock models' own caches,
stored quantized while their own decoding loops run."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from aqtr.flax.kv_cache import (
  CacheRule,
  QuantizedCache,
  StoredCache,
  cache_bytes,
  quantize_cache,
  store,
)

HEADS, HEAD, LEN = 2, 32, 16


class Attention(nn.Module):
  """Hugging Face Flax style: 'cache' collection with cached_key,
  cached_value [b, S, n, h] and cache_index, created by an init with
  `init_cache=True` and written at cache_index on later calls."""

  heads: int = HEADS
  head: int = HEAD

  @nn.compact
  def __call__(self, x, init_cache: bool = False):
    b, t, _ = x.shape

    def proj(name):
      return nn.DenseGeneral((self.heads, self.head), name=name)

    q, k, v = proj('q')(x), proj('k')(x), proj('v')(x)
    decoding = self.has_variable('cache', 'cached_key')
    ck = self.variable('cache', 'cached_key', jnp.zeros, k.shape, k.dtype)
    cv = self.variable('cache', 'cached_value', jnp.zeros, v.shape, v.dtype)
    ci = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    queries = jnp.arange(t)
    if decoding:
      i = ci.value
      ck.value = lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
      cv.value = lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
      ci.value = i + t
      k, v, queries = ck.value, cv.value, i + queries
    mask = jnp.arange(k.shape[1])[None] <= queries[:, None]
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) / math.sqrt(self.head)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name='o')(out)


class LM(nn.Module):
  vocab: int = 32
  layers: int = 2

  @nn.compact
  def __call__(self, ids, positions, init_cache: bool = False):
    d = HEADS * HEAD
    x = nn.Embed(self.vocab, d)(ids) + nn.Embed(LEN, d)(positions)
    for i in range(self.layers):
      x = x + Attention(name=f'h_{i}')(nn.LayerNorm()(x), init_cache)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _greedy(model, params, prompt, steps):
  """The model's own loop: init the cache, prefill, then one token a step."""
  zeros = jnp.zeros((1, LEN), jnp.int32)
  cache = model.init(jax.random.key(1), zeros, zeros, init_cache=True)
  cache = cache['cache']
  step = jax.jit(
    lambda c, ids, pos: model.apply(
      {'params': params, 'cache': c}, ids, pos, mutable=['cache']
    )
  )
  ids = jnp.asarray([prompt], jnp.int32)
  pos = jnp.arange(len(prompt))[None]
  out, logits = [], []
  for _ in range(steps):
    lg, new = step(cache, ids, pos)
    cache = new['cache']
    logits.append(lg[:, -1])
    tok = int(jnp.argmax(lg[0, -1]))
    out.append(tok)
    pos = pos[:, -1:] + 1
    ids = jnp.asarray([[tok]], jnp.int32)
  return out, jnp.stack(logits), cache


@pytest.fixture(scope='module')
def lm():
  model = LM()
  zeros = jnp.zeros((1, LEN), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), zeros, zeros)['params']
  return model, params


PROMPT = [3, 1, 4, 1, 5]


def test_a_float_cache_by_rule_is_the_models_own_decoding_bit_for_bit(lm):
  model, params = lm
  own = _greedy(model, params, PROMPT, 6)
  ruled = quantize_cache(model, CacheRule(numerics='none'))
  got = _greedy(ruled, params, PROMPT, 6)
  assert got[0] == own[0]
  np.testing.assert_array_equal(got[1], own[1])


@pytest.mark.parametrize('numerics', ['int8', 'int4', 'fp8'])
def test_linen_caches_are_stored_quantized_and_decode_close(lm, numerics):
  model, params = lm
  tokens, logits, fcache = _greedy(model, params, PROMPT, 6)
  ruled = quantize_cache(model, CacheRule(numerics=numerics))
  got, qlogits, qcache = _greedy(ruled, params, PROMPT, 6)
  stored = qcache['h_0']['cached_key']
  assert isinstance(stored, StoredCache) and stored.scale.shape == (
    1,
    LEN,
    HEADS,
  )
  ratio = cache_bytes(qcache) / cache_bytes(fcache)
  assert ratio <= {'int8': 0.3, 'fp8': 0.3, 'int4': 0.17}[numerics], ratio
  err = float(jnp.max(jnp.abs(qlogits - logits)) / jnp.max(jnp.abs(logits)))
  assert err < {'int8': 0.02, 'fp8': 0.1, 'int4': 0.3}[numerics], err
  if numerics == 'int8':
    assert got == tokens


def test_stored_tokens_keep_their_codes_from_step_to_step(lm):
  model, params = lm
  ruled = quantize_cache(model, CacheRule(numerics='int8'))
  _, _, c3 = _greedy(ruled, params, PROMPT, 3)
  _, _, c6 = _greedy(ruled, params, PROMPT, 6)
  # Slots 0..6 hold the prompt and two decoded tokens in both runs.
  a, b = c3['h_1']['cached_value'], c6['h_1']['cached_value']
  np.testing.assert_array_equal(a.codes[:, :7], b.codes[:, :7])
  np.testing.assert_allclose(a.scale[:, :7], b.scale[:, :7], rtol=1e-6)


def test_rules_match_by_module_path_and_names(lm):
  model, params = lm
  ruled = quantize_cache(
    model,
    [
      CacheRule(numerics='none', path='h_0'),
      CacheRule(numerics='int8', names=('cached_value',)),
    ],
  )
  _, _, cache = _greedy(ruled, params, PROMPT, 1)
  assert not isinstance(cache['h_0']['cached_value'], StoredCache)
  assert isinstance(cache['h_1']['cached_value'], StoredCache)
  assert not isinstance(cache['h_1']['cached_key'], StoredCache)


def test_a_rule_matching_no_cache_variable_is_one_line(lm):
  model, params = lm
  ruled = quantize_cache(model, CacheRule(path='decoder/.*'))
  with pytest.raises(ValueError, match=r'rules\[0\].*matched no cache var'):
    _greedy(ruled, params, PROMPT, 1)


def test_packed_int4_needs_an_even_head_size():
  x = jnp.ones((1, 4, 2, 5))
  with pytest.raises(ValueError, match=r'head size 5 \(odd\)'):
    store(CacheRule(numerics='int4'), x, 'h_0/attn/cached_key')


@pytest.mark.parametrize(
  'kw, msg',
  [
    ({'numerics': 'int3'}, 'CacheRule.numerics must be one of'),
    ({'calibration': 'static'}, "bound is set exactly when calibration='st"),
    ({'bound': 2.0}, "bound is set exactly when calibration='static'"),
    ({'names': 'cached_key'}, 'names must be a tuple of strings'),
  ],
)
def test_bad_rules_are_one_line(kw, msg):
  with pytest.raises((ValueError, TypeError), match=msg):
    CacheRule(**kw)


def test_static_bounds_clip_to_the_bound():
  x = jnp.asarray([[[0.5, -3.0]]])
  s = store(CacheRule(calibration='static', bound=1.0), x, 'k')
  np.testing.assert_allclose(s.dequant(), [[[0.5, -1.0]]], atol=1 / 127)


class NnxLM(nnx.Module):
  def __init__(self, rngs, vocab=32, layers=2):
    d = HEADS * HEAD
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Embed(LEN, d, rngs=rngs)
    self.layers = nnx.List(
      [
        nnx.MultiHeadAttention(
          num_heads=HEADS,
          in_features=d,
          decode=True,
          rngs=rngs,
        )
        for _ in range(layers)
      ]
    )
    self.out = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, ids, positions):
    x = self.embed(ids) + self.pos(positions)
    for layer in self.layers:
      x = x + layer(x)
    return self.out(x)


def _nnx_greedy(model, prompt, steps):
  """One token a step through the cache (nnx attention decodes one)."""

  @nnx.jit
  def step(model, ids, pos):
    return model(ids, pos)

  toks, logits = list(prompt), []
  for p in range(len(prompt) + steps - 1):
    lg = step(model, jnp.asarray([[toks[p]]]), jnp.asarray([[p]]))
    if p >= len(prompt) - 1:
      logits.append(lg[:, -1])
      toks.append(int(jnp.argmax(lg[0, -1])))
  return toks[len(prompt) :], jnp.stack(logits)


def _nnx_model(rule=None):
  model = NnxLM(nnx.Rngs(0))
  for layer in model.layers:
    layer.init_cache((1, LEN, HEADS * HEAD))
  if rule is not None:
    quantize_cache(model, rule)
  return model


def test_nnx_caches_by_rule():
  own = _nnx_greedy(_nnx_model(), PROMPT, 5)
  same = _nnx_greedy(_nnx_model(CacheRule(numerics='none')), PROMPT, 5)
  assert same[0] == own[0]
  np.testing.assert_array_equal(same[1], own[1])
  model = _nnx_model(CacheRule(numerics='int8'))
  assert isinstance(model.layers[0].cached_key, QuantizedCache)
  assert not isinstance(model.layers[0].cache_index, QuantizedCache)
  got = _nnx_greedy(model, PROMPT, 5)
  err = float(jnp.max(jnp.abs(got[1] - own[1])) / jnp.max(jnp.abs(own[1])))
  assert err < 0.02, err
  q = cache_bytes(nnx.state(model, nnx.Cache))
  f = cache_bytes(nnx.state(_nnx_model(), nnx.Cache))
  assert q / f <= 0.3, q / f
  with pytest.raises(ValueError, match='matched no cache variable'):
    _nnx_model(CacheRule(path='encoder.*'))


@pytest.mark.slow
def test_hugging_face_flax_gpt2_generate_with_a_cache_by_rule():
  # (FlaxLlamaForCausalLM of transformers 4.57 fails its own generate on a
  # tiny config: its rotary tables are half the head size.)
  transformers = pytest.importorskip('transformers')
  cls = getattr(transformers, 'FlaxGPT2LMHeadModel', None)
  if cls is None:
    pytest.skip('this transformers has no Flax GPT-2')
  config = transformers.GPT2Config(
    vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2
  )
  with jax.numpy_rank_promotion('allow'):  # Hugging Face code broadcasts.
    model = cls(config, seed=0)
  ids = jnp.asarray([[5, 9, 2, 7]])

  def generate(rule):
    original = model.module  # The linen module `generate` calls.
    if rule is not None:
      assert quantize_cache(model, rule) is model
      assert model.module is not original
    try:
      out = model.generate(ids, max_length=16, do_sample=False)
    finally:
      model._module = original
    return np.asarray(out.sequences)

  with jax.numpy_rank_promotion('allow'):  # Hugging Face code broadcasts.
    own = generate(None)
    same = generate(CacheRule(numerics='none'))
    got = generate(CacheRule(numerics='int8'))
  np.testing.assert_array_equal(same, own)
  assert got.shape == own.shape and (got[:, :4] == own[:, :4]).all()
