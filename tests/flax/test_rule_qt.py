"""QT through rules: params that live quantized on a stock linen model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import aqtr.flax
from aqtr import qt
from aqtr.flax import qt_rules
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(0), (8, 32))
RULE = Rule(qt.formats.dot_config(qt.int8()), weight=True)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, name='down')(jax.nn.relu(nn.Dense(64, name='up')(x)))


@pytest.mark.slow
def test_qt_params_train_and_serve_exactly_their_stored_values():
  q = aqtr.flax.quantize(Mlp(), RULE)
  v = jax.jit(q.init)(jax.random.key(0), X)
  qparams, rep = qt.quantize_params(v['params'], [qt.Rule()])
  qt_rules.check(q, rep, X, variables=v)
  tx = qt.quantized_training(optax.adam(1e-3), seed=0)
  state = tx.init(qparams)

  @jax.jit
  def step(qp, state, x):
    loss = lambda p: jnp.mean(q.apply({'params': p}, x) ** 2)  # noqa: E731
    grads = jax.grad(loss)(qt.dequantize(qp))
    updates, state = tx.update(grads, state, qp)
    return qt.apply_updates(qp, updates), state

  qparams, state = step(qparams, state, X)
  trained = {'params': qt.dequantize(qparams)}
  sm, sv = aqtr.flax.convert(q, X, variables=trained)
  # The served int8 values are QT's stored ones, bit for bit.
  held = sv['params']['up']['kernel'].frozen['dot_general0_rhs']
  frozen = next(iter(held.values()))['rhs']
  stored = qparams['up']['kernel']
  np.testing.assert_array_equal(
    np.asarray(frozen['qvalue']).reshape(stored.qvalue.shape), stored.qvalue
  )
  np.testing.assert_array_equal(
    jax.jit(sm.apply)(sv, X), jax.jit(q.apply)(trained, X)
  )


class Tied(nn.Module):
  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(16, 32, name='emb')
    return emb.attend(jnp.tanh(nn.Dense(32, name='mid')(emb(ids))))


def test_qt_param_read_outside_quantized_ops_is_one_line():
  ids = jnp.zeros((2, 4), jnp.int32)
  q = aqtr.flax.quantize(Tied(), [Rule(None, path='mid'), RULE])
  v = jax.eval_shape(q.init, jax.random.key(0), ids)
  with pytest.raises(
    ValueError, match=r"^mid/dot_general0: QT keeps param 'mid/kernel'"
  ):
    qt_rules.check(q, ('mid/kernel',), ids, variables=v)
  with pytest.raises(ValueError, match=r'^emb/embedding: .*outside weight'):
    qt_rules.check(q, ('emb/embedding',), ids, variables=v)
  with pytest.raises(ValueError, match=r'^mid/bias: .*no op'):
    qt_rules.check(q, ('mid/bias',), ids, variables=v)
