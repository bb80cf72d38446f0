"""aqtr.pax.decode on bad input: one clear line, never silent tokens."""

from __future__ import annotations

import functools

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from aqtr.pax import decode, templates

V, L = 16, 8


@functools.cache
def _model():
  cfg = templates.transformer_lm(
    vocab_size=V, d_model=8, num_layers=1, num_heads=2, hidden_dim=16, max_len=L
  )
  lm = fdl.build(cfg)
  return lm, lm.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))


def test_decoder_of_a_non_lm_says_what_it_takes():
  with pytest.raises(TypeError, match='lm must be a built aqtr.pax.Transfor'):
    decode.Decoder(nn.Dense(4))


@pytest.mark.parametrize(
  'prompts, match',
  [
    ([[1.7, 2]], r'prompt 0 must be a flat list of int token ids'),
    (['abc'], r"prompt 0 is text \('abc'\); give token ids"),
    ([[1, 'a']], r'prompt 0 must be a flat list of int'),
    ([[[1, 2]]], r'prompt 0 must be a flat list'),
    ('abc', r'prompts must be a list of token-id lists'),
  ],
)
def test_prompts_must_be_int_token_ids(prompts, match):
  lm, params = _model()
  with pytest.raises(TypeError, match=match):
    decode.Decoder(lm).generate(params, prompts, 2)


def test_generate_names_its_variables():
  lm, params = _model()
  with pytest.raises(ValueError, match=r'generate: variables must be .*got k'):
    decode.Decoder(lm).generate(params['params'], [[1, 2]], 2)


def test_step_without_a_cache_is_one_line():
  lm, params = _model()
  with pytest.raises(TypeError, match='step: cache must be the Cache'):
    decode.Decoder(lm).step(params, jnp.array([1]), None)


def test_nan_weights_raise_instead_of_tokens():
  lm, params = _model()
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  with pytest.raises(ValueError, match='non-finite logits'):
    decode.Decoder(lm).generate(bad, [[1, 2]], 3)


def test_a_decoder_reused_with_other_dtypes_recompiles():
  lm, params = _model()
  dec = decode.Decoder(lm)
  want = dec.generate(params, [[1, 2]], 3).tokens
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert len(dec.generate(half, [[1, 2]], 3).tokens[0]) == 3
  assert dec.generate(params, [[1, 2]], 3).tokens == want


@pytest.mark.parametrize(
  'tokens, error, match',
  [
    (
      [1.7],
      TypeError,
      r'step: tokens must be int token ids of shape \[batch\]',
    ),
    ([[1]], TypeError, r'step: tokens must be int token ids .*\(1, 1\)'),
    ([V], ValueError, rf'step: tokens: token {V} is outside the vocabulary'),
    ([-1], ValueError, r'token -1 is outside the vocabulary \[0, 16\)'),
  ],
)
def test_step_tokens_are_checked(tokens, error, match):
  # A float token was truncated and an out-of-vocabulary one gave NaN
  # logits, silently.
  lm, params = _model()
  dec = decode.Decoder(lm)
  _, cache = dec.prefill(params, *dec.pad([[1, 2]]))
  with pytest.raises(error, match=match) as e:
    dec.step(params, tokens, cache)
  assert '\n' not in str(e.value)


def test_prefill_ids_are_checked():
  lm, params = _model()
  dec = decode.Decoder(lm)
  start = jnp.zeros(1, jnp.int32)
  with pytest.raises(TypeError, match=r'prefill: ids must be int token ids'):
    dec.prefill(params, [[1.5, 2.0]], start)
  with pytest.raises(ValueError, match=rf'prefill: ids: token {V} is outsi'):
    dec.prefill(params, [[1, V]], start)


def test_a_step_on_a_full_cache_is_refused():
  # It used to run and overwrite the last slot.
  lm, params = _model()
  dec = decode.Decoder(lm)
  _, cache = dec.prefill(params, *dec.pad([[1] * L]))
  with pytest.raises(ValueError, match=r'step: the cache is full \(8 slots'):
    dec.step(params, [1], cache)
