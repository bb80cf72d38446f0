"""The Pax LM under explicit mesh axes: 3 Adam steps equal one device.

The LM (untied embedding, int8 injected or float) trains data parallel
over 8 devices and data x model over 2 x 4 with `AxisType.Explicit`;
parameters whose last axis the model axis divides are split along it.

Float: the losses equal one device's to 1e-6 (only float summation order
differs). int8: to 1e-6 until a rounding of an operand that XLA computes
with last-bit differences (its float reductions sum in an order that
depends on the per-device batch shape) flips; Adam carries that to later
steps. Those steps are bounded by the same model's drift on ONE device
when each example is compiled alone (`lax.map`), a mathematically equal
step with another float order (see tests/train/test_mesh.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import aqtr
from aqtr.pax import next_token_loss, sharding
from aqtr.train import models

pytestmark = pytest.mark.skipif(
  jax.device_count() != 8, reason='needs 8 host devices (tests/conftest.py)'
)

STEPS = 3


@functools.cache
def _module(name):
  t = models.lm(vocab_size=64, seq_len=16, d_model=32, num_layers=1)
  cfg = aqtr.presets.int8() if name == 'int8' else None
  return models.build(models.inject(t, cfg)[0])


def _ids():
  return jax.random.randint(jax.random.key(1), (8, 16), 0, 64)


def _train(name, params, ids, per_example=False):
  module, tx = _module(name), optax.adam(1e-2)

  def logits(p):
    if not per_example:
      return module.apply({'params': p}, ids)

    def one(i):
      return module.apply({'params': p}, i[None])[0]

    return jax.lax.map(one, ids)

  @jax.jit
  def step(p, opt):
    loss, g = jax.value_and_grad(lambda p: next_token_loss(logits(p), ids))(p)
    updates, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, updates), opt, loss

  opt, losses = tx.init(params), []
  for _ in range(STEPS):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  return np.array(losses), params


@functools.cache
def _one_device(name, per_example=False):
  params = jax.jit(_module(name).init)(jax.random.key(0), _ids())['params']
  return params, _train(name, params, _ids(), per_example)[0]


def _on_mesh(name, shape):
  params, _ = _one_device(name)
  axes = ('data', 'model')[: len(shape)]
  mesh = jax.make_mesh(
    shape, axes, axis_types=(AxisType.Explicit,) * len(shape)
  )

  def place(p):
    split = 'model' in axes and p.ndim >= 2 and p.shape[-1] % shape[1] == 0
    spec = P(*(None,) * (p.ndim - 1), 'model') if split else P()
    return NamedSharding(mesh, spec)

  with jax.set_mesh(mesh):
    params = jax.device_put(params, jax.tree.map(place, params))
    ids = jax.device_put(_ids(), NamedSharding(mesh, P('data')))
    return _train(name, params, ids)


@pytest.mark.parametrize(
  'name, shape',
  [
    pytest.param('float', (2, 4), marks=pytest.mark.slow),
    pytest.param('int8', (8,), marks=pytest.mark.slow),
    ('int8', (2, 4)),
  ],
)
def test_lm_under_explicit_axes_matches_one_device(name, shape):
  _, want = _one_device(name)
  got, params = _on_mesh(name, shape)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  if name == 'float':
    np.testing.assert_allclose(got, want, rtol=1e-5)
  else:
    drift = np.abs(got - want)
    if np.any(drift > 1e-6 * want):  # Then within the float-order drift.
      reorder = np.abs(_one_device(name, per_example=True)[1] - want)
      assert np.all(drift <= np.maximum(reorder, 1e-6 * want)), (drift, reorder)
  kernel = params['softmax']['kernel']
  split = [a for a in kernel.sharding.spec if a]
  assert split == ['model'] * (len(shape) - 1)  # The split is kept.


@pytest.mark.parametrize('heads, spec', [(4, P('data', None, 'model', None))])
def test_heads_take_the_model_axis_when_it_divides(heads, spec):
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  )
  x = jnp.arange(2 * 3 * 8.0).reshape(2, 3, 8)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P('data', None, 'model')))
    split = jax.jit(sharding.split_heads, static_argnums=1)(xs, heads)
    assert split.sharding.spec == spec
    merged = jax.jit(sharding.merge_heads)(split)
    assert merged.sharding.spec == P('data', None, 'model')
    two = jax.jit(sharding.split_heads, static_argnums=1)(xs, 2)
    assert two.sharding.spec == P('data', None, None, None)  # Gathered.
  np.testing.assert_array_equal(split, x.reshape(2, 3, heads, -1))
  np.testing.assert_array_equal(two, x.reshape(2, 3, 2, -1))
  np.testing.assert_array_equal(merged, x)


def test_lookup_is_sharded_like_the_ids():
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  )
  table = jnp.arange(10 * 8.0).reshape(10, 8)
  ids = jnp.array([[1, 9], [0, 3]])
  with jax.set_mesh(mesh):
    t = jax.device_put(table, NamedSharding(mesh, P(None, 'model')))
    i = jax.device_put(ids, NamedSharding(mesh, P('data')))
    out = jax.jit(sharding.lookup)(t, i)
    assert out.sharding.spec == P('data', None, 'model')
  np.testing.assert_array_equal(out, table[ids])
