"""aqtr.maxtext: MaxText's quantization names and Qwix-style rules."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr.flax
from aqtr import calibrations, maxtext, numerics, presets, tilings

X = jax.random.normal(jax.random.key(0), (2, 8, 16))


class Block(nnx.Module):  # stock nnx: two Linears and raw attention
  def __init__(self, rngs):
    self.qk = nnx.Linear(16, 32, rngs=rngs)
    self.out = nnx.Linear(16, 16, rngs=rngs)

  def __call__(self, x):
    q, k = jnp.split(self.qk(x), 2, axis=-1)
    a = jax.nn.softmax(jnp.einsum('bqd,bkd->bqk', q, k)) @ x
    return self.out(a)


def _loss_and_grads(model):
  def loss(m):
    return jnp.mean(m(X) ** 2)

  return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.mark.parametrize('name', maxtext.NAMES)
def test_each_name_trains_a_stock_model(name):
  kw = {}
  if name == 'intmp':
    kw['mixed_precision'] = {
      '__default__': {'w_bits': 8, 'a_bits': 8},
      'qk': {'w_bits': 4, 'tile_size': 8},
    }
  if name == 'fp8_full':
    kw['constant_bound_config'] = (4.0, 1.0, None, None, None, None)
  model = Block(nnx.Rngs(0))
  qmodel = aqtr.flax.quantize(model, maxtext.rules(name, **kw))
  report = aqtr.flax.report(qmodel, X, strict=True)
  # Weight contractions quantized; attention's two activation dots float.
  assert report.quantized_paths() == ['qk/dot_general0', 'out/dot_general0']
  assert report.float_paths() == ['einsum0', 'dot_general0']
  ref, ref_g = _loss_and_grads(model)
  val, g = _loss_and_grads(qmodel)
  assert val != ref  # quantized
  np.testing.assert_allclose(val, ref, rtol=0.2)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(
      np.linalg.norm(a), np.linalg.norm(b), rtol=0.35, atol=1e-3
    )


def test_names_build_their_presets_and_the_generic_form_agrees():
  dot = maxtext.dot_config
  same = {
    'int8': (presets.int8(), dot(weight=8, activation=8, backward=8)),
    'int8w': (presets.int8_weight_only(), dot(weight=jnp.int8)),
    'int4w': (presets.int4_weight_only(), dot(weight='int4')),
    'fp8': (
      presets.fp8(),
      dot(weight='e4m3', activation=jnp.float8_e4m3fn, backward='e5m2'),
    ),
    'fp8_nanoo': (
      presets.fp8_nanoo(),
      dot(weight='e4m3fnuz', activation='e4m3fnuz', backward='e5m2fnuz'),
    ),
    'fp8_full': (presets.fp8_full(), presets.fp8_full()),
  }
  for name, (preset, generic) in same.items():
    assert maxtext.config(name) == preset == generic, name
  assert maxtext.config('nanoo_fp8') == presets.fp8_nanoo()
  # A preset shows by name in the report; fp8_full's static bounds apply.
  assert maxtext.rules('int8')[0].config == 'int8'
  # weight=None widens activation-quantizing names to every op, not
  # weight-only ones (a weight-only config has no activation to quantize).
  assert maxtext.rules('int8', weight=None)[0].weight is None
  assert maxtext.rules('int8w', weight=None)[0].weight is True
  (r,) = maxtext.rules('fp8_full', constant_bound_config=(1, 2, 3, 4, 5, 6))
  assert r.config.drhs.rhs.calibration == calibrations.Constant(bound=6.0)
  assert r.config.fwd.lhs.tiling == tilings.PerTensor()


def test_intmp_rules_last_regex_wins_then_default(tmp_path):
  mp = {
    '__default__': {'w_bits': 8, 'a_bits': 8, 'a_scale': 0.9},
    'q.*': {'w_bits': 8},  # MaxText: the later 'qk' wins for qk
    'qk': {'w_bits': 4, 'a_bits': None, 'tile_size': 8},
  }
  path = tmp_path / 'mp.json'
  path.write_text(json.dumps(mp))
  for spec in (mp, str(path)):
    rules = maxtext.rules('intmp', mixed_precision=spec)
    assert [r.path for r in rules] == ['qk', 'q.*', None]
    qmodel = aqtr.flax.quantize(Block(nnx.Rngs(0)), rules)
    with pytest.warns(UserWarning, match=r"rule 1 Rule\(.*path='q\.\*'"):
      cfg = aqtr.flax.report(qmodel, X).configs()
    qk, out = cfg['qk/dot_general0'], cfg['out/dot_general0']
    assert qk.fwd.rhs.numerics.bits == 4 and not qk.fwd.lhs.quantized
    assert qk.fwd.rhs.tiling == tilings.SubChannel(tile_size=8)
    assert out.fwd.lhs.calibration == calibrations.AbsMax(clip_scale=0.9)
    assert not out.dlhs.lhs.quantized  # forward only, as MaxText's intmp


def test_qt_rules_quantize_attention_with_the_activation_numerics():
  rules = maxtext.qt_rules(
    weight='int4', activation='int8', backward='int8', tile_size=8
  )
  assert [r.weight for r in rules] == [True, False]
  report = aqtr.flax.report(aqtr.flax.quantize(Block(nnx.Rngs(0)), rules), X)
  cfg = report.configs()
  assert cfg['qk/dot_general0'].fwd.rhs.numerics.bits == 4
  assert cfg['einsum0'].fwd.rhs.numerics.bits == 8
  assert cfg['einsum0'].fwd.lhs.tiling == tilings.SubChannel(tile_size=8)
  assert len(report.quantized_paths()) == 4
  (one,) = maxtext.qt_rules(weight='e4m3', activation='e4m3', path='qk')
  assert one.weight is None and one.config.fwd.lhs.numerics == numerics.Fp8(
    dtype_name='float8_e4m3fn', clip_gradient=False
  )
  (wo,) = maxtext.qt_rules(weight=8, calibration='minmax')
  assert wo.weight is True
  assert wo.config.fwd.rhs.calibration == calibrations.MinMax()


@pytest.mark.parametrize(
  'call, match',
  [
    (lambda: maxtext.rules('int9'), 'quantization must be one of int8, '),
    (lambda: maxtext.config('intmp'), "quantization='intmp' sets a config"),
    (lambda: maxtext.rules('intmp'), 'mixed_precision is needed by'),
    (
      lambda: maxtext.rules('int8', mixed_precision={}),
      'mixed_precision is needed by',
    ),
    (
      lambda: maxtext.rules('int8', constant_bound_config=(1,) * 6),
      'constant_bound_config is only for',
    ),
    (
      lambda: maxtext.rules('fp8_full', constant_bound_config=(1,) * 5),
      'fp8_full: constant_bounds must be',
    ),
    (lambda: maxtext.rules('int8', weight=False), 'weight must be True'),
    (
      lambda: maxtext.rules('intmp', mixed_precision={'a': {'bits': 8}}),
      r"mixed_precision\['a'\] has unknown keys \['bits'\]",
    ),
    (lambda: maxtext.rules('intmp', mixed_precision=[1]), 'mixed_precision'),
    (lambda: maxtext.dot_config(weight='int9'), 'weight must be None'),
    (lambda: maxtext.dot_config(backward=jnp.float32), 'backward must be'),
    (lambda: maxtext.dot_config(weight=8, tile_size=0), 'tile_size must be'),
    (
      lambda: maxtext.dot_config(weight=8, calibration='nope'),
      'calibration must be a Calibration or one of absmax',
    ),
    (
      lambda: maxtext.dot_config(weight=8, weight_clip=1.5),
      r'weight_clip must be in \(0, 1\]',
    ),
  ],
)
def test_bad_arguments_name_the_argument(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize(
  'entry, match',
  [
    ({'w_bits': 9}, r"\['mlp/.*'\]: w_bits must be None, bits 2..8"),
    ({'w_bits': 8, 'w_scale': 1.5}, r'\]: w_scale must be in \(0, 1\]'),
    ({'w_scale': 1.5}, r'\]: w_scale must be in \(0, 1\]'),
    ({'a_bits': 'eight'}, r'\]: a_bits must be None, bits 2..8'),
    ({'a_bits': 8, 'a_scale': True}, r'\]: a_scale must be in \(0, 1\]'),
  ],
)
def test_intmp_errors_name_the_key_and_its_regex(entry, match):
  with pytest.raises(ValueError, match=match):
    maxtext.rules('intmp', mixed_precision={'mlp/.*': entry})


def test_intmp_file_that_is_not_json_names_the_file(tmp_path):
  path = tmp_path / 'mp.json'
  path.write_text('{not json')
  with pytest.raises(ValueError, match=r"file '.*mp.json' cannot be read as"):
    maxtext.rules('intmp', mixed_precision=str(path))
  with pytest.raises(ValueError, match='cannot be read as JSON'):
    maxtext.rules('intmp', mixed_precision=str(tmp_path / 'missing.json'))


def test_rules_weight_flag_is_true_or_none_not_one():
  with pytest.raises(ValueError, match='weight must be True or None, got 1'):
    maxtext.rules('int8', weight=1)
