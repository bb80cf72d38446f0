"""Linear: parameters, float exactness, quantized op injection."""

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr.pax import EinsumOp, Linear

from .helpers import apply, init

X = jax.random.normal(jax.random.key(0), (2, 3, 8))


def test_params_and_float_output():
  layer = Linear(features=4)
  params = init(layer, X)['params']
  assert jax.tree.map(jnp.shape, params) == {'kernel': (8, 4), 'bias': (4,)}
  params = {'kernel': params['kernel'], 'bias': jnp.arange(4.0)}
  got = apply(layer, {'params': params}, X)
  want = (
    jnp.einsum('btd,df->btf', X, params['kernel']) + jnp.arange(4.0)[None, None]
  )
  np.testing.assert_array_equal(got, want)


def test_quantized_op_same_params_close_output():
  float_layer = Linear(features=4, use_bias=False)
  q_layer = Linear(
    features=4, use_bias=False, einsum=EinsumOp(config=aqtr.presets.int8())
  )
  params = init(float_layer, X)
  assert jax.tree.structure(params) == jax.tree.structure(init(q_layer, X))
  f = apply(float_layer, params, X)
  q = apply(q_layer, params, X)
  assert not np.array_equal(f, q)
  np.testing.assert_allclose(q, f, atol=0.05 * float(jnp.abs(f).max()))
