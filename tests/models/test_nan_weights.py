"""NaN weights refused before a stock model's own decoding loop runs.

Inside a Hugging Face Flax LM's jitted `generate` nothing can raise: a NaN
weight gives NaN logits and greedy decoding returns token 0 at every step.
`aqtr.flax.quantize_cache` (the cache rule) and `aqtr.flax.convert` (the
int8 weights) check the weights once and name the parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import zoo
from flax import nnx

import aqtr.flax
from aqtr.flax.kv_cache import CacheRule, quantize_cache
from aqtr.rules import Rule

BAD = ('transformer', 'h', '0', 'attn', 'c_attn', 'kernel')


def _gpt2_with_a_nan():
  transformers = pytest.importorskip('transformers')
  cfg = transformers.GPT2Config(
    vocab_size=zoo.VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=16
  )
  hf = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
  params = jax.tree.map(lambda x: x, hf.params)
  node = params
  for k in BAD[:-1]:
    node = node[k]
  node[BAD[-1]] = node[BAD[-1]].at[0, 0].set(jnp.nan)
  hf.params = params
  return hf, params


def test_kv_cache_rule_refuses_nan_weights_of_a_hugging_face_lm():
  hf, _ = _gpt2_with_a_nan()
  where = 'params/' + '/'.join(BAD)
  with pytest.raises(ValueError, match=f'quantize_cache: parameter {where} '):
    quantize_cache(hf, CacheRule(numerics='int8'))


def test_convert_refuses_nan_weights_naming_the_parameter():
  hf, params = _gpt2_with_a_nan()
  q = aqtr.flax.quantize(hf.module, [Rule('int8', path='.*/h/.*')])
  ids = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match='convert: parameter ' + '/'.join(BAD)):
    aqtr.flax.convert(
      q, ids, ids, jnp.arange(8)[None], variables={'params': params}
    )


def test_kv_cache_rule_refuses_nan_weights_of_an_nnx_model():
  layer = nnx.MultiHeadAttention(
    num_heads=2, in_features=8, qkv_features=8, decode=True,
    rngs=nnx.Rngs(0),
  )  # fmt: skip
  layer.init_cache((1, 4, 8))
  layer.key.kernel.set_value(layer.key.kernel.get_value().at[0].set(jnp.inf))
  with pytest.raises(ValueError, match='parameter key/kernel holds NaN or inf'):
    quantize_cache(layer, CacheRule(numerics='int8'))
