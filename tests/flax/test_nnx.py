"""Tests for aqtr.flax.nnx: modes, train == serve, errors, rngs, sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_cases import INIT, KINDS, bitwise, data, nnx_layer, weights_config

import aqtr
import aqtr.flax.nnx as qn
from aqtr.flax.frozen import is_removed
from aqtr.freezers import Mode


@nnx.jit
def _forward(m, x):
  return m(x)


def _op(m):
  (op,) = [op for _, op in qn.ops(m)]
  return op


def _rhs(m):
  (entry,) = _op(m).frozen_entries().values()
  return entry['rhs']


@pytest.mark.parametrize('kind', KINDS)
def test_serve_equals_train_bit_for_bit(kind):
  m = nnx_layer(kind, weights_config())
  x, x2 = data(kind), data(kind, seed=5, scale=3.0)
  train, train2 = _forward(m, x), _forward(m, x2)
  assert qn.convert(m, x) is m
  assert _op(m).mode is Mode.SERVE
  bitwise(_forward(m, x), train)
  bitwise(_forward(m, x2), train2)


@pytest.mark.parametrize('kind', ['dense', 'conv'])
def test_float_kernel_is_removed_and_not_read(kind):
  m = nnx_layer(kind, weights_config())
  x = data(kind)
  kernel = m.kernel.get_value()
  qn.convert(m, x)
  assert is_removed(m.kernel)
  assert m.kernel.get_metadata('kernel_shape') == kernel.shape
  assert m.kernel[...].shape == kernel.shape
  state = nnx.state(m)
  assert not any(
    leaf.shape == kernel.shape and leaf.dtype == kernel.dtype
    for leaf in jax.tree_util.tree_leaves(state)
  )
  served = _forward(m, x)
  for k in (jnp.zeros_like(kernel), kernel):
    m.kernel = nnx.Param(k)
    bitwise(_forward(m, x), served)
  part = _rhs(m)
  part['qvalue'] = jnp.zeros_like(part['qvalue'])
  op = _op(m)
  (name,) = op.frozen_entries()
  getattr(op, name).set_value({'rhs': part})
  out = _forward(m, x)
  assert not np.array_equal(out, served)
  bias = m.bias.get_value()
  np.testing.assert_array_equal(out, jnp.broadcast_to(bias, out.shape))


def test_serving_kernels_are_int8_with_per_channel_scales():
  m = nnx_layer('einsum', weights_config())
  qn.convert(m, data('einsum'))
  rhs = _rhs(m)
  # kernel [5, 2, 3] contracted over d=5: 6 output channels, stored with
  # the contraction minor ('fk' view, an int8 x int8 dot).
  assert rhs['qvalue'].dtype == jnp.int8 and rhs['qvalue'].shape == (1, 1, 6, 5)
  assert rhs['scale'].shape == (1, 1, 6, 1)
  assert isinstance(_op(m).frozen_entries(), dict)


def test_serving_without_frozen_values_names_the_fix():
  m = nnx_layer('dense', weights_config())
  qn.set_mode(m, Mode.SERVE)
  with pytest.raises(ValueError, match=r'aqtr\.flax\.nnx\.convert'):
    m(data('dense'))


def test_config_mismatch_between_convert_and_serve_is_detected():
  m = nnx_layer('dense', weights_config())
  x = data('dense')
  qn.convert(m, x)
  _op(m).config = weights_config(aqtr.presets.int4_weight_only)
  with pytest.raises(ValueError, match='different forward quantization'):
    m(x)
  # Frozen values copied from a model converted under another config.
  other = nnx_layer('dense', weights_config(aqtr.presets.int8_weight_only))
  qn.set_mode(other, Mode.SERVE)
  (name,) = _op(m).frozen_entries()
  setattr(_op(other), name, qn.Frozen(_op(m).frozen_entries()[name]))
  with pytest.raises(ValueError, match='different forward quantization'):
    other(x)


def test_convert_needs_a_freezer_and_restores_modes_on_failure():
  m = nnx_layer('dense', aqtr.presets.int8())
  with pytest.raises(ValueError, match='no op wrote frozen values'):
    qn.convert(m, data('dense'))
  m = nnx_layer('dense', weights_config())
  with pytest.raises(TypeError):
    qn.convert(m, 'not an array')
  assert _op(m).mode is Mode.TRAIN


def test_static_calibration_updates_only_in_calibrate_and_serves():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int8(), lhs='calibration', rhs='weights'
  )
  m = nnx_layer('dense', cfg)
  xs = [data('dense', seed=i, scale=1.0 + i) for i in range(3)]
  _forward(m, xs[0])
  assert not hasattr(_op(m), 'stats_lhs')
  qn.set_mode(m, Mode.CALIBRATE)
  for x in xs:
    _forward(m, x)
  stats = _op(m).stats_lhs.get_value()
  assert int(stats['count']) == 3
  want = np.mean([float(jnp.abs(x).max()) for x in xs])
  assert float(stats['mean']) == pytest.approx(want, rel=1e-6)
  qn.set_mode(m, Mode.TRAIN)
  _forward(m, xs[0])
  assert int(_op(m).stats_lhs.get_value()['count']) == 3
  qn.convert(m, xs[0])
  assert not hasattr(_op(m), 'stats_lhs')
  (entry,) = _op(m).frozen_entries().values()
  b = entry['lhs']['bound']
  assert float(b) == float(stats['mean'])
  big = 10 * xs[0]
  bitwise(_forward(m, big), _forward(m, jnp.clip(big, -b, b)))


def test_stochastic_rounding_needs_rngs_only_when_used():
  cfg = aqtr.freezers.configure(
    aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True),
    rhs='weights',
  )
  x = data('dense')
  plain = nnx.Linear(8, 6, dot_general=qn.DotGeneral(cfg), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r'rngs=nnx\.Rngs\(quant=seed\)'):
    plain(x)
  op = qn.DotGeneral(cfg, rngs=nnx.Rngs(quant=1))
  m = nnx.Linear(8, 6, dot_general=op, rngs=nnx.Rngs(0))

  @nnx.jit
  def grad(m):
    return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)

  g1, g2 = grad(m), grad(m)  # the stream advances between calls
  assert not np.array_equal(g1.kernel.get_value(), g2.kernel.get_value())
  # Serving (forward rounds to nearest) needs no key at all.
  qn.convert(plain, x)
  plain(x)


def test_out_sharding_is_accepted():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('d',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  m = nnx_layer('dense', weights_config())
  x = data('dense')
  want = _forward(m, x)
  got = nnx.jit(lambda m, x: m(x, out_sharding=sharding))(m, x)
  bitwise(got, want)
  e = nnx_layer('einsum', weights_config())
  xe = data('einsum')
  bitwise(
    nnx.jit(lambda m, x: m(x, out_sharding=sharding))(e, xe), _forward(e, xe)
  )


def test_float_and_none_configs_are_the_stock_layer():
  x = data('conv')
  for cfg in (None, aqtr.presets.float()):
    m = nnx_layer('conv', cfg)
    ref = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0), **INIT)
    bitwise(m(x), ref(x))


def test_report_counts_removed_and_frozen_bytes():
  m = nnx_layer('conv', weights_config())
  qn.convert(m, data('conv'))
  r = aqtr.flax.sizes(m)
  assert r.float_kernel_bytes == 3 * 3 * 3 * 4 * 4
  assert r.frozen_kernel_bytes == 27 * 4 + 4 * 4
  assert 'kernels' in str(r)
