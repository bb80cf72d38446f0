"""Per-block cache scales (`CacheRule(block=B)`): one scale per head and
block of B slots, through `quantize_cache` and the stock decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kv_cache import LEN, LM

from aqtr.flax.decode import Decoder
from aqtr.flax.kv_cache import (
  BlockCache,
  CacheRule,
  cache_bytes,
  quantize_cache,
  store,
)

X = jax.random.normal(jax.random.key(0), (2, 64, 4, 16))  # [b, S, n, h]


def _rel(a, b):
  return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))


@pytest.mark.parametrize('numerics', ['int8', 'int4', 'fp8'])
def test_block_scales_cut_bytes_and_stay_close_to_per_token(numerics):
  tok = store(CacheRule(numerics=numerics), X, 'k')
  blk = store(CacheRule(numerics=numerics, block=32), X, 'k')
  assert isinstance(blk, BlockCache) and blk.scale.shape == (2, 2, 4)
  assert blk.codes.shape == tok.codes.shape
  h = X.shape[-1]
  code = h // 2 if numerics == 'int4' else h
  assert cache_bytes(blk) == X.size // h * (code + 4 / 32)
  assert cache_bytes(blk) < cache_bytes(tok)
  e_tok, e_blk = _rel(tok.dequant(), X), _rel(blk.dequant(), X)
  assert e_tok < e_blk < 2.5 * e_tok + 1e-3, (e_tok, e_blk)


def test_a_block_equals_per_token_scales_of_its_largest_token():
  x = jnp.ones((1, 4, 1, 2)).at[0, 2].set(3.0)
  blk = store(CacheRule(block=4), x, 'k')
  np.testing.assert_allclose(blk.scale, [[[3.0 / 127]]])
  np.testing.assert_allclose(blk.dequant(), x, rtol=1 / 127)


def test_block_caches_decode_close_through_the_models_own_loop():
  model = LM()
  zeros = jnp.zeros((1, LEN), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), zeros, zeros)
  prompt = [3, 1, 4, 1, 5]
  rule = CacheRule(numerics='int8', block=8)

  def next_logits(dec):  # A step reads the cache the prefill stored.
    _, cache, start = dec.prefill(variables, [prompt])
    return dec.step(variables, [7], cache, len(prompt), start)

  want, _ = next_logits(Decoder(model, length=LEN, vocab=32))
  got, cache = next_logits(Decoder(model, length=LEN, kv=rule, vocab=32))
  assert isinstance(cache['h_0']['cached_key'], BlockCache)
  err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  assert 0 < err < 0.03, err
  lifted = quantize_cache(model, rule)  # The linen lift stores blocks too.
  init = lifted.init(jax.random.key(1), zeros, zeros, init_cache=True)
  assert isinstance(init['cache']['h_1']['cached_value'], BlockCache)


def test_bad_blocks_are_one_line():
  with pytest.raises(ValueError, match='CacheRule.block must be an int >= 0'):
    CacheRule(block=-1)
  with pytest.raises(ValueError, match=r'CacheRule\(block=48\) scales blocks'):
    store(CacheRule(block=48), X, 'h_0/cached_key')
