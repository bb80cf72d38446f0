"""Attention: causal masking, heads, the two einsum ops injectable."""

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.pax import templates

from .helpers import apply, init

X = jax.random.normal(jax.random.key(0), (2, 5, 8))


def _layer(**kw):
  return fdl.build(templates.attention(8, 2, **kw))


def test_causal_future_does_not_leak():
  att = _layer()
  params = init(att, X)
  y = apply(att, params, X)
  x2 = X.at[:, -1].set(100.0)
  y2 = apply(att, params, x2)
  np.testing.assert_allclose(y[:, :-1], y2[:, :-1], rtol=1e-5, atol=1e-6)
  assert not np.allclose(y[:, -1], y2[:, -1])


def test_non_causal_sees_the_future():
  att = _layer(causal=False)
  params = init(att, X)
  y = apply(att, params, X)
  y2 = apply(att, params, X.at[:, -1].set(100.0))
  assert not np.allclose(y[:, 0], y2[:, 0])


def test_reference_math():
  att = _layer(causal=False)
  params = init(att, X)
  p = params['params']

  def proj(name, x):
    return x @ p[name]['kernel'] + p[name]['bias'][None, None]

  q, k, v = (
    proj(n, X).reshape(2, 5, 2, 4) for n in ('q_proj', 'k_proj', 'v_proj')
  )
  logits = jnp.einsum('btnh,bsnh->bnts', q, k) / 2.0
  out = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits, -1), v)
  want = proj('o_proj', out.reshape(2, 5, 8))
  np.testing.assert_allclose(apply(att, params, X), want, rtol=1e-4, atol=1e-5)


def test_qk_and_pv_injectable_separately():
  cfg = templates.attention(8, 2)
  params = init(fdl.build(cfg), X)
  base = apply(fdl.build(cfg), params, X)
  outs = []
  for name in ('qk_einsum', 'pv_einsum'):
    c = templates.attention(8, 2)
    getattr(c, name).config = aqtr.presets.int8()
    outs.append(apply(fdl.build(c), params, X))
  assert not np.array_equal(outs[0], base)
  assert not np.array_equal(outs[1], base)
  assert not np.array_equal(outs[0], outs[1])


def test_heads_must_divide():
  cfg = templates.attention(8, 2)
  cfg.num_heads = 3
  with pytest.raises(ValueError, match='num_heads=3'):
    init(fdl.build(cfg), X)
