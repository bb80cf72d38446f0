"""Block and TransformerLm: shapes, parameter trees, tied/untied, loss."""

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.pax import next_token_loss, templates

from .helpers import (
  SEQ,
  VOCAB,
  apply,
  float_lm,
  tiny_lm,
  tokens,
  zeros_like_init,
)


def _shapes(cfg):
  model = fdl.build(cfg)
  return jax.tree.map(
    jnp.shape, jax.eval_shape(model.init, jax.random.key(0), tokens())
  )


def test_param_tree_tied():
  p = _shapes(tiny_lm())['params']
  assert set(p) == {
    'embedding',
    'layers_0',
    'layers_1',
    'final_norm',
    'position_embedding',
  }
  assert p['embedding'] == {'embedding': (VOCAB, 32)}
  assert set(p['layers_0']) == {
    'attention',
    'ffn',
    'attention_norm',
    'ffn_norm',
  }
  assert set(p['layers_0']['attention']) == {
    'q_proj',
    'k_proj',
    'v_proj',
    'o_proj',
  }


def test_param_tree_untied_gated_layer_norm():
  p = _shapes(tiny_lm(tied=False, gated=True, norm_kind='layer'))['params']
  assert p['softmax'] == {'kernel': (32, VOCAB)}
  assert set(p['layers_1']['ffn']) == {'wi', 'wi_gate', 'wo'}
  assert set(p['final_norm']) == {'scale', 'bias'}


def test_block_is_residual():
  cfg = templates.block(8, 2, 16)
  block = fdl.build(cfg)
  x = jax.random.normal(jax.random.key(0), (1, 4, 8))
  zero = zeros_like_init(block, x)
  np.testing.assert_array_equal(apply(block, zero, x), x)


def test_lm_is_causal():
  lm, params = float_lm()
  ids = tokens()
  a = apply(lm, params, ids)
  b = apply(lm, params, ids.at[:, -1].set((ids[:, -1] + 1) % VOCAB))
  np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-5, atol=1e-5)


def test_too_long_sequence():
  lm = fdl.build(tiny_lm())
  ids = jnp.zeros((1, SEQ + 1), jnp.int32)
  with pytest.raises(ValueError, match='max_len'):
    jax.eval_shape(lm.init, jax.random.key(0), ids)


def test_next_token_loss_uniform():
  logits = jnp.zeros((2, 5, VOCAB))
  ids = jnp.zeros((2, 5), jnp.int32)
  np.testing.assert_allclose(next_token_loss(logits, ids), np.log(VOCAB))
