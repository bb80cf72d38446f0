"""QT through rules on a stock nnx model: params that live quantized."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import aqtr.flax
from aqtr import qt
from aqtr.flax import qt_rules
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(0), (8, 32))
RULE = Rule(qt.formats.dot_config(qt.int8()), weight=True)


class Mlp(nnx.Module):
  def __init__(self):
    self.up = nnx.Linear(32, 64, rngs=nnx.Rngs(0))
    self.down = nnx.Linear(64, 32, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


class Tied(nnx.Module):
  def __init__(self):
    self.embed = nnx.Embed(16, 32, rngs=nnx.Rngs(0))

  def __call__(self, ids):
    return self.embed.attend(self.embed(ids))


@pytest.mark.slow
def test_nnx_qt_params_train_and_serve_exactly_their_stored_values():
  q = aqtr.flax.quantize(Mlp(), RULE)
  graphdef, params = nnx.split(q, nnx.Param)
  qparams, rep = qt.quantize_params(nnx.to_pure_dict(params), [qt.Rule()])
  assert rep.quantized == ('down/kernel', 'up/kernel')
  qt_rules.check(q, rep, X)
  tx = qt.quantized_training(optax.adam(1e-3), seed=0)

  def model(p):
    state = nnx.State(params)
    nnx.replace_by_pure_dict(state, p)
    return nnx.merge(graphdef, state)

  @jax.jit
  def step(qp, opt, x):
    loss = lambda p: jnp.mean(model(p)(x) ** 2)  # noqa: E731
    grads = jax.grad(loss)(qt.dequantize(qp))
    updates, opt = tx.update(grads, opt, qp)
    return qt.apply_updates(qp, updates), opt

  qparams, _ = step(qparams, tx.init(qparams), X)
  served = aqtr.flax.convert(model(qt.dequantize(qparams)), X)
  # The served int8 values are QT's stored ones, bit for bit.
  entry = served.up.kernel.entries()['dot_general0_rhs']
  frozen = next(iter(entry.values()))['rhs']
  stored = qparams['up']['kernel']
  np.testing.assert_array_equal(
    np.asarray(frozen['qvalue']).reshape(stored.qvalue.shape), stored.qvalue
  )


def test_nnx_qt_param_read_outside_weight_operands_is_one_line():
  q = aqtr.flax.quantize(Tied(), RULE)
  ids = jnp.arange(4)[None]
  with pytest.raises(ValueError) as e:
    qt_rules.check(q, ('embed/embedding',), ids)
  msg = str(e.value)
  assert msg.startswith('embed/embedding: QT keeps this param quantized')
  assert 'outside weight operands' in msg and '\n' not in msg
