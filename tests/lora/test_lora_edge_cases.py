"""LoRA on bad input: one clear line naming the argument, and eager
whole-tree gradients that match the forward."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aqtr import lora

X = jax.random.normal(jax.random.key(1), (3, 64))


@pytest.mark.parametrize('alpha', [float('inf'), float('nan'), True, -1.0])
def test_alpha_must_be_finite_and_positive(alpha):
  with pytest.raises(ValueError, match='LoraConfig.alpha must be > 0 and fin'):
    lora.LoraConfig(alpha=alpha)


def test_dropout_takes_a_number_not_a_bool():
  with pytest.raises(ValueError, match='LoraConfig.dropout'):
    lora.LoraConfig(dropout=False)


class _Conv(nnx.Module):
  def __init__(self):
    self.conv = nnx.Conv(2, 4, (3,), rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.conv(x)


def test_attach_to_a_conv_only_model_says_convolutions_take_no_adapter():
  with pytest.raises(ValueError, match='matches only convolutions; adapters'):
    lora.attach(_Conv(), lora.LoraConfig(rank=1), jnp.ones((1, 5, 2)))


def test_attach_twice_says_the_model_has_adapters():
  lm = lora.attach(nnx.Linear(64, 8, rngs=nnx.Rngs(0)), lora.LoraConfig(), X)
  with pytest.raises(ValueError, match='already has adapters; attach to'):
    lora.attach(lm, lora.LoraConfig(), X)


def _linen_lora(base=None):
  m = nn.Dense(8)
  v = m.init(jax.random.key(0), X)
  return lora.attach(m, lora.LoraConfig(rank=2, base=base), X, variables=v)


@pytest.mark.parametrize('fn', ['sizes', 'merge'])
def test_linen_sizes_and_merge_without_variables_name_them(fn):
  lm, _ = _linen_lora()
  with pytest.raises(TypeError, match=f'aqtr.lora.{fn}: a linen model needs'):
    getattr(lora, fn)(lm, X)


def test_merge_names_requantize():
  lm, v = _linen_lora('nf4')
  with pytest.raises(ValueError, match="requantize: unknown preset 'nf5'"):
    lora.merge(lm, X, variables=v, requantize='nf5')


def _ones_b(params):
  return jax.tree_util.tree_map_with_path(
    lambda p, x: jnp.ones_like(x) if 'lora_b' in str(p[-1]) else x, params
  )


def test_linen_eager_whole_tree_grad_matches_the_forward():
  lm, v = _linen_lora()
  params = _ones_b(v['params'])

  def loss(p):
    return jnp.sum(lm.apply({'params': p}, X) ** 2)

  val, g = jax.value_and_grad(loss)(params)
  jval, jg = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(val, loss(params), rtol=1e-5)
  np.testing.assert_allclose(
    g['lora_b_dot_general0'], jg['lora_b_dot_general0'], rtol=1e-4
  )


def test_nnx_value_and_grad_default_filter_matches_the_forward():
  lm = lora.attach(nnx.Linear(64, 8, rngs=nnx.Rngs(0)), lora.LoraConfig(), X)
  b = lm.lora_b_dot_general0
  b.set_value(jnp.ones_like(b.get_value()))

  def loss(m):
    return jnp.sum(m(X) ** 2)

  want = loss(lm)
  val, _ = nnx.value_and_grad(loss)(lm)
  np.testing.assert_allclose(val, want, rtol=1e-5)
