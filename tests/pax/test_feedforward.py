"""FeedForward: plain and gated."""

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.pax import FeedForward, Linear

from .helpers import apply, init

X = jax.random.normal(jax.random.key(0), (2, 3, 4))


def test_plain():
  ffn = FeedForward(wi=Linear(features=8), wo=Linear(features=4))
  params = init(ffn, X)
  assert set(params['params']) == {'wi', 'wo'}
  p = params['params']
  h = jax.nn.gelu(X @ p['wi']['kernel'] + p['wi']['bias'][None, None])
  np.testing.assert_allclose(
    apply(ffn, params, X),
    h @ p['wo']['kernel'] + p['wo']['bias'][None, None],
    rtol=1e-5,
  )


def test_gated():
  ffn = FeedForward(
    wi=Linear(features=8, use_bias=False),
    wo=Linear(features=4, use_bias=False),
    wi_gate=Linear(features=8, use_bias=False),
    activation=jax.nn.silu,
  )
  params = init(ffn, X)
  p = {k: v['kernel'] for k, v in params['params'].items()}
  h = jax.nn.silu(X @ p['wi_gate']) * (X @ p['wi'])
  np.testing.assert_allclose(apply(ffn, params, X), h @ p['wo'], rtol=1e-5)
  assert jnp.shape(p['wi_gate']) == (4, 8)
