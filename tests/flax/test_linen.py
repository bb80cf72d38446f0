"""Tests for aqtr.flax.linen: modes, train == serve, errors, rng streams."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax_cases import (
  KINDS,
  bitwise,
  data,
  linen_layer,
  weights_config,
)

import aqtr
import aqtr.flax.linen as ql
from aqtr.core import codecs
from aqtr.flax.frozen import is_removed
from aqtr.freezers import Mode, lifecycle


@functools.cache
def _apply(kind, cfg, mode):
  """A jitted apply of the `kind` layer in `mode` (compiled once)."""
  return jax.jit(linen_layer(kind, cfg, mode).apply)


def _init(kind, cfg, x):
  """Variables of the `kind` layer in TRAIN mode (jitted init)."""
  return jax.jit(linen_layer(kind, cfg, Mode.TRAIN).init)(jax.random.key(0), x)


def _converted(kind, cfg=None, seed=0):
  cfg = cfg or weights_config()
  x = data(kind, seed)
  v = _init(kind, cfg, x)
  serving = ql.convert(linen_layer(kind, cfg, Mode.CONVERT), v, x)
  return cfg, x, v, serving


def _entry(serving):
  """The only frozen entry of a one-layer model: {'rhs': {...}}."""
  (op,) = serving[ql.FROZEN].values()
  (entry,) = op.values()
  return entry


@pytest.mark.parametrize('kind', KINDS)
def test_serve_equals_train_bit_for_bit(kind):
  cfg, x, v, serving = _converted(kind)
  train = _apply(kind, cfg, Mode.TRAIN)(v, x)
  served = _apply(kind, cfg, Mode.SERVE)(serving, x)
  bitwise(served, train)
  # Other inputs too: the frozen weights do not depend on the sample input.
  x2 = data(kind, seed=5, scale=3.0)
  bitwise(
    _apply(kind, cfg, Mode.SERVE)(serving, x2),
    _apply(kind, cfg, Mode.TRAIN)(v, x2),
  )


@pytest.mark.parametrize('kind', KINDS)
def test_float_kernel_is_removed_and_not_read(kind):
  cfg, x, v, serving = _converted(kind)
  kernel = serving['params']['kernel']
  assert is_removed(kernel)
  assert kernel.shape == v['params']['kernel'].shape
  assert jax.tree_util.tree_leaves(kernel) == []
  served = _apply(kind, cfg, Mode.SERVE)(serving, x)
  # Putting the float kernel back, zeroed or not, changes nothing.
  for k in (jnp.zeros_like(v['params']['kernel']), v['params']['kernel']):
    back = dict(serving, params=dict(serving['params'], kernel=k))
    bitwise(_apply(kind, cfg, Mode.SERVE)(back, x), served)
  # Zeroing the frozen qvalues does change it (only the bias remains).
  zeroed = jax.tree_util.tree_map_with_path(
    lambda p, a: (
      jnp.zeros_like(a) if 'qvalue' in jax.tree_util.keystr(p) else a
    ),
    serving,
  )
  out = _apply(kind, cfg, Mode.SERVE)(zeroed, x)
  assert not np.array_equal(out, served)
  bias = v['params']['bias']
  np.testing.assert_array_equal(out, jnp.broadcast_to(bias, out.shape))


def test_serving_kernels_are_int8_with_per_channel_scales():
  cfg, x, v, serving = _converted('dense_general')
  rhs = _entry(serving)['rhs']
  # kernel [4, 5, 2, 3]: contraction 20, 6 output channels, stored with
  # the contraction minor ('fk' view, an int8 x int8 dot).
  assert rhs['qvalue'].dtype == jnp.int8
  assert rhs['qvalue'].shape == (1, 1, 6, 20)
  assert rhs['scale'].dtype == jnp.float32
  assert rhs['scale'].shape == (1, 1, 6, 1)
  assert set(serving['params']) == {'kernel', 'bias'}
  assert set(serving) == {'params', ql.FROZEN}


def test_int4_weights_are_stored_as_int4():
  cfg = weights_config(aqtr.presets.int4_weight_only)
  cfg, x, v, serving = _converted('conv', cfg)
  stored = _entry(serving)['rhs']
  assert stored['int4'].dtype == jnp.uint8  # Two 4-bit codes per byte.
  assert stored['int4'].shape == (1, 1, 27, 2)
  rhs = codecs.decode_parts(stored, cfg.fwd.rhs.numerics)
  assert rhs['qvalue'].dtype == jnp.int4
  assert rhs['qvalue'].shape == (1, 1, 27, 4)
  assert int(jnp.abs(rhs['qvalue'].astype(jnp.int8)).max()) == 7
  bitwise(
    _apply('conv', cfg, Mode.SERVE)(serving, x),
    _apply('conv', cfg, Mode.TRAIN)(v, x),
  )


def test_serving_without_frozen_values_names_collection_and_fix():
  cfg = weights_config()
  x = data('dense')
  v = _init('dense', cfg, x)
  with pytest.raises(ValueError, match=r"collection 'aqtr'.*convert"):
    linen_layer('dense', cfg, Mode.SERVE).apply(v, x)


def test_config_mismatch_between_convert_and_serve_is_detected():
  cfg, x, v, serving = _converted('dense')
  other = aqtr.freezers.configure(
    aqtr.presets.fully_quantized(7, 8), rhs='weights'
  )
  with pytest.raises(ValueError, match='different forward quantization'):
    linen_layer('dense', other, Mode.SERVE).apply(serving, x)
  # A different freezer choice is a different config too.
  lhs_too = aqtr.freezers.configure(cfg, lhs='calibration')
  with pytest.raises(ValueError, match='different forward quantization'):
    linen_layer('dense', lhs_too, Mode.SERVE).apply(serving, x)


def test_convert_needs_ops_in_convert_mode_and_a_freezer():
  cfg = weights_config()
  x = data('dense')
  v = _init('dense', cfg, x)
  with pytest.raises(ValueError, match='no op wrote frozen values'):
    ql.convert(linen_layer('dense', cfg, Mode.TRAIN), v, x)
  plain = aqtr.presets.int8()
  with pytest.raises(ValueError, match='no op wrote frozen values'):
    ql.convert(linen_layer('dense', plain, Mode.CONVERT), v, x)
  with pytest.raises(ValueError, match='mutable'):
    linen_layer('dense', cfg, Mode.CONVERT).apply(v, x)


def test_modes_without_freezers_are_train():
  cfg = aqtr.presets.int8()
  x = data('dense')
  v = _init('dense', cfg, x)
  want = linen_layer('dense', cfg, Mode.TRAIN).apply(v, x)
  for mode in (Mode.CALIBRATE, Mode.SERVE):
    bitwise(linen_layer('dense', cfg, mode).apply(v, x), want)


def test_float_and_none_configs_are_the_stock_layer():
  x = data('conv')
  for cfg in (None, aqtr.presets.float()):
    layer = linen_layer('conv', cfg, Mode.TRAIN)
    v = jax.jit(layer.init)(jax.random.key(0), x)
    bitwise(layer.apply(v, x), nn.Conv(4, (3, 3)).apply(v, x))


def test_conv_kernel_gradients_are_the_quantized_vjp():
  cfg = aqtr.presets.int8()
  x = data('conv')
  layer = linen_layer('conv', cfg, Mode.TRAIN)
  v = jax.jit(layer.init)(jax.random.key(0), x)

  def loss(p):
    return jnp.sum(layer.apply({'params': p}, x) ** 2)

  def ref(p):
    y = aqtr.conv_general_dilated(
      x,
      p['kernel'],
      (1, 1),
      'SAME',
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
      config=cfg,
    )
    return jnp.sum((y + p['bias'].reshape(1, 1, 1, -1)) ** 2)

  g = jax.jit(jax.grad(loss))(v['params'])
  assert float(jnp.abs(g['kernel']).min()) >= 0
  assert float(jnp.abs(g['kernel']).max()) > 0
  want = jax.jit(jax.grad(ref))(v['params'])
  np.testing.assert_allclose(g['kernel'], want['kernel'], rtol=1e-5)


def test_stochastic_rounding_needs_the_rng_stream_only_when_used():
  cfg = aqtr.freezers.configure(
    aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True),
    rhs='weights',
  )
  x = data('dense')
  layer = linen_layer('dense', cfg, Mode.TRAIN)
  v = jax.jit(layer.init)(jax.random.key(0), x)  # no 'quant' stream

  def loss(p, key):
    rngs = {} if key is None else {'quant': key}
    return jnp.sum(layer.apply({'params': p}, x, rngs=rngs) ** 2)

  with pytest.raises(ValueError, match="PRNG stream 'quant'") as err:
    jax.grad(loss)(v['params'], None)
  # The fix it names is valid Python (issue 9: it had a stray '}').
  assert str(err.value).endswith("pass rngs={'quant': key} to apply.")
  grad = jax.jit(jax.grad(loss))
  g1 = grad(v['params'], jax.random.key(1))
  g2 = grad(v['params'], jax.random.key(2))
  assert not np.array_equal(g1['kernel'], g2['kernel'])
  # Inference modes round the forward pass to nearest: no stream needed.
  serving = ql.convert(linen_layer('dense', cfg, Mode.CONVERT), v, x)
  linen_layer('dense', cfg, Mode.SERVE).apply(serving, x)
  # Deterministic configs never ask for the stream.
  plain = weights_config()
  linen_layer('dense', plain, Mode.TRAIN).apply(v, x)


def test_freezers_on_backward_or_float_operands_are_rejected():
  cfg = aqtr.presets.int8_weight_only()
  with pytest.raises(ValueError, match='not quantized'):
    lifecycle.validate(aqtr.freezers.configure(cfg, lhs='weights'))
  x = data('dense')
  bad = aqtr.freezers.configure(cfg, lhs='weights')
  with pytest.raises(ValueError, match='nothing to freeze'):
    linen_layer('dense', bad, Mode.TRAIN).init(jax.random.key(0), x)


def test_weights_frozen_model_trains_then_serves_its_training_numbers():
  """A few QAT steps, then CONVERT: SERVE matches the trained TRAIN model."""
  cfg = weights_config()
  x = data('dense')
  y = jnp.asarray(np.random.default_rng(1).standard_normal((3, 6)))
  layer = linen_layer('dense', cfg, Mode.TRAIN)
  p = _init('dense', cfg, x)['params']

  @jax.jit
  def step(p):
    g = jax.grad(lambda p: jnp.mean((layer.apply({'params': p}, x) - y) ** 2))
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g(p))

  for _ in range(3):
    p = step(p)
  serving = ql.convert(
    linen_layer('dense', cfg, Mode.CONVERT), {'params': p}, x
  )
  bitwise(
    _apply('dense', cfg, Mode.SERVE)(serving, x),
    _apply('dense', cfg, Mode.TRAIN)({'params': p}, x),
  )


def test_static_calibration_updates_only_in_calibrate_and_serves():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int8(), lhs='calibration', rhs='weights'
  )
  xs = [data('dense', seed=i, scale=1.0 + i) for i in range(3)]
  v = _init('dense', cfg, xs[0])
  assert ql.STATS not in v
  _, upd = linen_layer('dense', cfg, Mode.TRAIN).apply(
    v, xs[0], mutable=[ql.STATS]
  )
  assert not upd.get(ql.STATS)
  cal = linen_layer('dense', cfg, Mode.CALIBRATE)
  # init of a CALIBRATE model creates the statistics without counting.
  fresh = jax.jit(cal.init)(jax.random.key(0), xs[0])
  assert int(fresh[ql.STATS]['DotGeneral_0']['lhs']['count']) == 0
  with pytest.raises(ValueError, match="mutable=\\['aqtr_stats'\\]"):
    cal.apply(v, xs[0])
  step = jax.jit(lambda v, x: cal.apply(v, x, mutable=[ql.STATS])[1])
  for x in xs:
    v = {**v, **step(v, x)}
  stats = v[ql.STATS]['DotGeneral_0']['lhs']
  assert int(stats['count']) == 3
  want = np.mean([float(jnp.abs(x).max()) for x in xs])
  assert float(stats['mean']) == pytest.approx(want, rel=1e-6)
  serving = ql.convert(linen_layer('dense', cfg, Mode.CONVERT), v, xs[0])
  assert ql.STATS not in serving
  b = _entry(serving)['lhs']['bound']
  assert float(b) == float(stats['mean'])
  serve = _apply('dense', cfg, Mode.SERVE)
  big = 10 * xs[0]
  bitwise(serve(serving, big), serve(serving, jnp.clip(big, -b, b)))
  assert not np.allclose(
    serve(serving, big), _apply('dense', cfg, Mode.TRAIN)(v, big), rtol=0.05
  )
