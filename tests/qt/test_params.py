"""QTParam trees: rules, reports, bytes, packing, serving operands."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import qt
from aqtr.qt import params as qparams
from aqtr.qt.formats import dot_config
from tests.qt import digits_mlp

DN = (((1,), (0,)), ((), ()))


def _mlp():
  return digits_mlp.init(0)


def test_default_rule_quantizes_kernels_only():
  q, report = qt.quantize_params(_mlp())
  assert report.quantized == tuple(f'Dense_{i}/kernel' for i in range(3))
  assert report.kept_float == tuple(f'Dense_{i}/bias' for i in range(3))
  assert report.unused_rules == ()
  assert isinstance(q['Dense_0']['kernel'], qt.QTParam)
  assert isinstance(q['Dense_0']['bias'], jax.Array)
  again, report2 = qt.quantize_params(q)  # Already quantized: kept.
  assert report2.quantized == report.quantized
  assert again['Dense_0']['kernel'] is q['Dense_0']['kernel']


def test_first_matching_rule_wins_and_reports():
  rules = [
    qt.Rule(pattern=r'Dense_2/kernel', fmt=qt.fp8(), name='head'),
    qt.Rule(fmt=qt.int4(64)),
  ]
  q, report = qt.quantize_params(_mlp(), rules)
  assert report.by_rule == {
    'head': ('Dense_2/kernel',),
    r'(^|/)kernel$': ('Dense_0/kernel', 'Dense_1/kernel'),
  }
  assert q['Dense_2']['kernel'].qvalue.dtype == jnp.float8_e4m3fn
  assert q['Dense_0']['kernel'].qvalue.dtype == jnp.uint8  # packed int4


def test_rule_selecting_nothing_warns_or_raises():
  rules = [qt.Rule(), qt.Rule(pattern='Conv', name='convs')]
  with pytest.warns(UserWarning, match=r"\['convs'\] selected no parameter"):
    _, report = qt.quantize_params(_mlp(), rules)
  assert report.unused_rules == ('convs',)
  with pytest.raises(ValueError, match='convs.*strict=True'):
    qt.quantize_params(_mlp(), rules, strict=True)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    qt.quantize_params(_mlp(), [qt.Rule()], strict=True)


def test_bad_rules():
  with pytest.raises(ValueError, match='not a valid regex'):
    qt.Rule(pattern='(')
  with pytest.raises(TypeError, match='Rule.fmt'):
    qt.Rule(fmt='int8')
  with pytest.raises(TypeError, match='aqtr.qt.Rule'):
    qt.quantize_params(_mlp(), ['kernel'])
  with pytest.raises(TypeError, match="'k'.*only float"):
    qt.quantize_params(
      {'k': jnp.ones((4, 4), jnp.int32)}, [qt.Rule(pattern='k')]
    )


@pytest.mark.parametrize(
  'fmt,limit', [(qt.int8(), 0.3), (qt.int4(32), 0.17), (qt.int4(64), 0.17)]
)
def test_param_bytes(fmt, limit):
  p = {'Dense_0': {'kernel': jnp.ones((256, 256))}}
  q, _ = qt.quantize_params(p, [qt.Rule(fmt=fmt)])
  ratio = qt.tree_bytes(q) / qt.tree_bytes(p)
  assert ratio <= limit
  # On the digits MLP, biases included.
  m = _mlp()
  mq, _ = qt.quantize_params(m, [qt.Rule(fmt=fmt)])
  assert qt.tree_bytes(mq) / qt.tree_bytes(m) <= limit


def test_int4_packing_round_trips():
  q = jnp.arange(-8, 8, dtype=jnp.int8).repeat(3)[:46].reshape(2, 23)
  packed = qparams.pack_int4(q)
  assert packed.dtype == jnp.uint8 and packed.size == q.size // 2
  np.testing.assert_array_equal(qparams.unpack_int4(packed, q.shape), q)


@pytest.mark.parametrize('fmt', [qt.int8(), qt.int4(32), qt.fp8()])
def test_dequant_error_and_layouts(fmt):
  w = jax.random.normal(jax.random.key(0), (3, 64, 5))
  rule = qt.Rule(
    fmt=qt.WeightFormat(
      kind=fmt.kind, group_size=fmt.group_size, contracting_axes=(1,)
    )
  )
  p = qt.quantize_params({'kernel': w}, [rule])[0]['kernel']
  assert p.shape == w.shape and p.form == 'fk'
  rel = {'int8': 0.01, 'int4': 0.15, 'fp8': 0.07}[fmt.kind]
  err = jnp.abs(p.dequant() - w).max(axis=1) / jnp.abs(w).max(axis=1)
  assert float(err.max()) < rel


def test_stochastic_requantization_keeps_serving_bit_exact():
  # Stochastic rounding of a group's largest weight could take it one
  # code below qmax; the engine would then re-calibrate the dequantized
  # weight to another scale and serving the stored values would differ
  # from the training forward (seen about once per 100 requantizations
  # before the top code was pinned).
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  fmt = qt.int8()
  cfg = dot_config(fmt)
  p = qt.quantize_params({'w': w}, [qt.Rule(pattern='w$', fmt=fmt)])[0]['w']
  noise = jnp.asarray(1e-3 * rng.standard_normal((300, 64, 32)), jnp.float32)

  def step(p, i):
    p = qt.requantize(p, p.dequant() + noise[i], key=jax.random.key(i))
    train = aqtr.dot_general(x, p.dequant(), DN, cfg)
    serve = aqtr.dot_general(x, p.qtensor(), DN, cfg)
    return p, jnp.all(train == serve)

  _, same = jax.lax.scan(step, p, jnp.arange(300))
  assert bool(same.all()), int((~same).sum())


def test_int8_params_serve_as_qtensor_bit_exactly():
  # The QT forward (dequantized weight, re-quantized by the engine) and
  # serving the stored int8 values as a QTensor operand agree bit for bit;
  # the gradient reaches the float weight.
  w = jax.random.normal(jax.random.key(1), (256, 96))
  w = w * jnp.exp(3 * jax.random.normal(jax.random.key(2), (1, 96)))
  p = qt.quantize_params({'kernel': w}, key=jax.random.key(3))[0]['kernel']
  x = jax.random.normal(jax.random.key(4), (8, 256))
  cfg = dot_config(qt.int8())

  def f(w):
    return aqtr.dot_general(x, w, DN, cfg)

  out, vjp = jax.vjp(f, p.dequant())
  serve = aqtr.dot_general(x, p.qtensor(), DN, cfg)
  np.testing.assert_array_equal(out, serve)
  g = vjp(jnp.ones_like(out))[0]
  # dW = Q(X)^T . 1: drhs reuses the forward's int8 activations.
  xq = aqtr.fake_quant(x)
  np.testing.assert_allclose(g, jnp.tile(xq.sum(0)[:, None], (1, 96)), 1e-5)
  assert not dot_config(qt.int8(), None).fwd.lhs.quantized


def test_requantize_names_the_shapes():
  # It used to fail inside a reshape.
  p = qt.quantize_params({'kernel': jnp.ones((64, 16))})[0]['kernel']
  with pytest.raises(ValueError, match=r'w has shape \(32, 16\).*\(64, 16\)'):
    qt.requantize(p, jnp.ones((32, 16)))
  with pytest.raises(TypeError, match='w must be a float array'):
    qt.requantize(p, jnp.ones((64, 16), jnp.int32))
  with pytest.raises(TypeError, match='p must be an aqtr.qt.QTParam'):
    qt.requantize(jnp.ones((64, 16)), jnp.ones((64, 16)))
  assert qt.requantize(p, jnp.ones((64, 16))).shape == (64, 16)
