"""Embedding, Softmax and the tied SharedEmbeddingSoftmax."""

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr.pax import EinsumOp, Embedding, SharedEmbeddingSoftmax, Softmax

from .helpers import apply, init

IDS = jnp.array([[0, 3, 1]])


def test_embedding_lookup():
  layer = Embedding(num_embeddings=5, features=4, scale_sqrt_depth=True)
  params = init(layer, IDS)
  table = params['params']['embedding']
  np.testing.assert_allclose(apply(layer, params, IDS), table[IDS] * 2.0)


def test_softmax_logits():
  layer = Softmax(num_classes=7, einsum=EinsumOp())
  x = jnp.ones((1, 3, 4))
  params = init(layer, x)
  w = params['params']['kernel']
  assert w.shape == (4, 7)
  np.testing.assert_allclose(apply(layer, params, x), x @ w, rtol=1e-6)


def test_shared_table_is_used_for_lookup_and_logits():
  layer = SharedEmbeddingSoftmax(num_classes=5, features=4)
  params = init(layer, IDS, method='embed')
  table = params['params']['embedding']
  assert list(params['params']) == ['embedding']
  x = apply(layer, params, IDS, method='embed')
  np.testing.assert_array_equal(x, table[IDS])
  np.testing.assert_allclose(apply(layer, params, x), x @ table.T, rtol=1e-6)


def test_shared_logits_quantized():
  cfg = aqtr.presets.int8()
  layer = SharedEmbeddingSoftmax(
    num_classes=5, features=4, einsum=EinsumOp(config=cfg)
  )
  params = init(layer, IDS, method='embed')
  x = jax.random.normal(jax.random.key(1), (1, 3, 4))
  table = params['params']['embedding']
  want = aqtr.einsum('bd,vd->bv', x[0], table, config=cfg)
  np.testing.assert_allclose(apply(layer, params, x)[0], want, rtol=1e-6)
