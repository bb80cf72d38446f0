"""quantized_training: the torchao claim on digits, keys, NaN steps, optax
composition, sharding."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from aqtr import qt
from aqtr.qt.lowbit import LowBitTensor
from tests.qt import digits_mlp


def _claim(steps, sr_tol, int4_tol):
  # torchao: with round-to-nearest small updates vanish and QT stalls;
  # stochastic rounding trains like float (AdamW, digits MLP).
  run = digits_mlp.run
  near = run('int8', 1e-4, steps, 'nearest')[0]
  sr, fl = run('int8', 1e-4, steps)[0], run('float', 1e-4, steps)[0]
  assert near < 0.40, near
  assert sr >= fl - sr_tol, (sr, fl)
  int4, fl3 = run('int4', 1e-3, steps)[0], run('float', 1e-3, steps)[0]
  assert int4 >= fl3 - int4_tol, (int4, fl3)


def test_sr_trains_like_float_and_nearest_stalls_small():
  _claim(200, 0.02, 0.02)


@pytest.mark.slow
def test_sr_trains_like_float_and_nearest_stalls_full():
  _claim(1500, 0.01, 0.015)


_JITTED = {}


def _jit_update(tx):
  if id(tx) not in _JITTED:
    _JITTED[id(tx)] = (tx, jax.jit(lambda p, s, g: tx.update(g, s, p)))
  return _JITTED[id(tx)][1]


def _tiny():
  w = jax.random.normal(jax.random.key(0), (32, 8))
  return qt.quantize_params({'kernel': w, 'bias': jnp.zeros(8)})[0]


def _grads(scale=1.0):
  g = scale * jax.random.normal(jax.random.key(1), (32, 8))
  return {'kernel': g, 'bias': jnp.ones(8)}


def _steps(tx, params, n, grads=None):
  state = tx.init(params)
  step = _jit_update(tx)
  for _ in range(n):
    u, state = step(params, state, grads or _grads())
    params = qt.apply_updates(params, u)
  return params, state


def test_key_sequence_is_deterministic_given_the_seed():
  tx = qt.quantized_training(optax.sgd(1e-3), seed=7)
  state = tx.init(_tiny())
  keys = [
    jax.random.key_data(qt.step_key(state._replace(count=jnp.int32(i))))
    for i in range(3)
  ]
  assert len({tuple(np.asarray(k).tolist()) for k in keys}) == 3
  expect = jax.random.fold_in(jax.random.key(7), 2)
  np.testing.assert_array_equal(keys[2], jax.random.key_data(expect))
  a, _ = _steps(tx, _tiny(), 3)
  b, _ = _steps(tx, _tiny(), 3)
  np.testing.assert_array_equal(a['kernel'].qvalue, b['kernel'].qvalue)
  other = qt.quantized_training(optax.sgd(1e-3), seed=8)
  c, _ = _steps(other, _tiny(), 3)
  assert (np.asarray(a['kernel'].qvalue) != c['kernel'].qvalue).any()


_INNER = {
  'adam': lambda: optax.adam(1e-2),
  'adamw_4bit': lambda: qt.adamw_4bit(1e-2, min_size=0),
}


@pytest.mark.parametrize(
  'inner,bad_value', [('adam', jnp.nan), ('adamw_4bit', jnp.inf)]
)
def test_non_finite_step_is_skipped_and_reported(inner, bad_value):
  tx = qt.quantized_training(_INNER[inner]())
  p0 = _tiny()
  state = tx.init(p0)
  bad = _grads()
  bad['kernel'] = bad['kernel'].at[3, 2].set(bad_value)
  u, s1 = _jit_update(tx)(p0, state, bad)
  p1 = qt.apply_updates(p0, u)
  np.testing.assert_array_equal(p1['kernel'].qvalue, p0['kernel'].qvalue)
  np.testing.assert_array_equal(p1['kernel'].scale, p0['kernel'].scale)
  np.testing.assert_array_equal(p1['bias'], p0['bias'])
  assert int(s1.skipped) == 1 and int(s1.count) == 1
  before, after = jax.tree.leaves(state.inner), jax.tree.leaves(s1.inner)
  for a, b in zip(after, before, strict=True):
    np.testing.assert_array_equal(a, b)
  u, s2 = _jit_update(tx)(p1, s1, _grads())
  assert int(s2.skipped) == 1
  assert (np.asarray(qt.apply_updates(p1, u)['bias']) != 0).all()


def test_finite_update_that_overflows_the_weight_is_skipped():
  # kernel 2e38 and gradient -2e38 under sgd(1): u = 2e38 is finite but
  # w + u overflows; it used to leave NaN weights with skipped == 0.
  tx = qt.quantized_training(optax.sgd(1.0))
  p0 = qt.quantize_params({'kernel': jnp.full((32, 8), 2e38)})[0]
  u, s1 = _jit_update(tx)(p0, tx.init(p0), {'kernel': jnp.full((32, 8), -2e38)})
  p1 = qt.apply_updates(p0, u)
  assert int(s1.skipped) == 1
  np.testing.assert_array_equal(p1['kernel'].qvalue, p0['kernel'].qvalue)
  np.testing.assert_array_equal(p1['kernel'].scale, p0['kernel'].scale)
  # The same for a float leaf.
  f0 = {'bias': jnp.full(4, 3e38)}
  tx = qt.quantized_training(optax.sgd(1.0))
  u, s1 = tx.update({'bias': jnp.full(4, -1e38)}, tx.init(f0), f0)
  assert int(s1.skipped) == 1
  np.testing.assert_array_equal(qt.apply_updates(f0, u)['bias'], f0['bias'])


def test_optax_apply_updates_on_qt_params_raises_naming_the_fix():
  # It used to add the int8 codes (wrapping) and sum the scales silently.
  tx = qt.quantized_training(optax.sgd(1e-2))
  p0 = _tiny()
  u, _ = _jit_update(tx)(p0, tx.init(p0), _grads())
  with pytest.raises(
    ValueError, match=r'apply it with aqtr\.qt\.apply_updates'
  ):
    optax.apply_updates(p0, u)
  p1 = qt.apply_updates(p0, u)
  assert p1['kernel'].role == qt.params.PARAM
  # The applied tree has the params' structure: it feeds the next step.
  assert jax.tree.structure(p1) == jax.tree.structure(p0)
  _steps(tx, p1, 1)


def test_nearest_warns_once_and_bad_arguments():
  with pytest.warns(qt.NearestRoundingWarning, match='stalls') as rec:
    near = qt.quantized_training(optax.sgd(1e-3), rounding='nearest')
  assert len(rec) == 1
  with warnings.catch_warnings():  # Once, at construction: steps are quiet.
    warnings.simplefilter('error')
    _steps(near, _tiny(), 2)
  with pytest.raises(ValueError, match='rounding must be one of'):
    qt.quantized_training(optax.sgd(1.0), rounding='up')
  tx = qt.quantized_training(optax.sgd(1.0))
  with pytest.raises(ValueError, match='needs params'):
    tx.update(_grads(), tx.init(_tiny()))
  with pytest.raises(TypeError, match='must be a QTParam'):
    qt.apply_updates(_tiny(), _grads())
  with pytest.raises(TypeError, match='inner must be an optax Gradient'):
    qt.quantized_training('adam')
  for seed in (1.5, 'a', True):
    with pytest.raises(TypeError, match='seed must be an int'):
      qt.quantized_training(optax.sgd(1.0), seed=seed)


@pytest.mark.parametrize('inner', ['adamw', 'adamw_8bit', 'adamw_4bit'])
def test_composes_with_clipping_schedules_and_lowbit_adam(inner):
  sched = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)
  make = {
    'adamw': optax.adamw,
    'adamw_8bit': qt.adamw_8bit,
    'adamw_4bit': qt.adamw_4bit,
  }[inner]
  kw = {'min_size': 0} if inner != 'adamw' else {}
  txs = {
    inner: optax.chain(
      optax.clip_by_global_norm(1.0), make(sched, weight_decay=0.1, **kw)
    )
  }
  tx = qt.quantized_training(txs[inner])
  p0 = _tiny()
  target = jax.random.normal(jax.random.key(5), (32, 8))

  def loss(p):
    return jnp.mean((p['kernel'] - target) ** 2)

  state = tx.init(p0)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(qt.dequantize(p))
    u, s = tx.update(g, s, p)
    return qt.apply_updates(p, u), s

  p = p0
  for _ in range(10):
    p, state = step(p, state)
  assert isinstance(p['kernel'], qt.QTParam)
  assert float(loss(qt.dequantize(p))) < 0.9 * float(loss(qt.dequantize(p0)))


def test_sharded_params_on_a_two_device_mesh():
  if jax.device_count() < 2:
    pytest.skip('needs 2 devices (tests/conftest.py sets 8 host devices)')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('model',))
  col = jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(None, 'model')
  )
  w = jax.random.normal(jax.random.key(0), (32, 8))
  tx = qt.quantized_training(optax.adam(1e-2))
  p_ref, _ = _steps(tx, qt.quantize_params({'kernel': w})[0], 3, {'kernel': w})
  ws = jax.device_put(w, col)
  p = qt.quantize_params({'kernel': ws})[0]
  state = tx.init(p)
  step = _jit_update(tx)
  for _ in range(3):
    u, state = step(p, state, {'kernel': ws})
    p = qt.apply_updates(p, u)
  assert len(p['kernel'].qvalue.sharding.device_set) == 2
  np.testing.assert_allclose(
    qt.dequantize(p)['kernel'], qt.dequantize(p_ref)['kernel'], atol=0.05
  )


def test_lowbit_adam_on_sharded_params():
  # QT kernel sharded by column, a float bias sharded too: the weights and
  # low-bit moments (adamw_4bit: block-wise m with stochastic rounding,
  # rank-1 v) match the unsharded run's.
  if jax.device_count() < 2:
    pytest.skip('needs 2 devices (tests/conftest.py sets 8 host devices)')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('model',))
  spec = jax.sharding.PartitionSpec
  w = jax.random.normal(jax.random.key(0), (128, 64))
  params = {'kernel': w, 'bias': jnp.zeros(64)}
  grads = {'kernel': jnp.sin(3 * w), 'bias': jnp.ones(64)}
  tx = qt.quantized_training(qt.adamw_4bit(1e-2, min_size=64))

  def run(params, grads):
    p = qt.quantize_params(params)[0]
    return _steps(tx, p, 2, grads)

  p_ref, s_ref = run(params, grads)
  shard = {
    'kernel': jax.sharding.NamedSharding(mesh, spec(None, 'model')),
    'bias': jax.sharding.NamedSharding(mesh, spec('model')),
  }
  p, s = run(jax.device_put(params, shard), jax.device_put(grads, shard))
  assert len(p['kernel'].qvalue.sharding.device_set) == 2

  def floats(p, s):  # Weights and decoded moments (sharding may change ulps).
    def dec(x):
      return x.decode() if isinstance(x, LowBitTensor) else x

    is_lb = lambda x: isinstance(x, LowBitTensor)  # noqa: E731
    return jax.tree.leaves(
      (qt.dequantize(p), jax.tree.map(dec, s.inner, is_leaf=is_lb))
    )

  got, want = floats(p, s), floats(p_ref, s_ref)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
