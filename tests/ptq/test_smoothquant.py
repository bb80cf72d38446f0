"""SmoothQuant: the scale formula, the unchanged float model, W8A8 dots."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
import aqtr.flax
import aqtr.ptq
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.ptq import fold, outliers, smoothquant
from aqtr.ptq.stats import LayerStats
from aqtr.rules import Rule
from aqtr.train import models, stock_lm

from . import lms


def _toy():
  x = jax.random.normal(jax.random.key(0), (64, 6))
  x = x * jnp.array([1.0, 40.0, 1.0, 0.5, 1.0, 2.0])[None]
  w1 = jax.random.normal(jax.random.key(1), (6, 5))
  w2 = jax.random.normal(jax.random.key(2), (6, 3)) * 3.0
  params = {
    'n': {'scale': jnp.ones(6)},
    'a': {'kernel': w1},
    'b': {'kernel': w2},
  }
  fm = fold.FoldMap(
    groups=(
      fold.FoldGroup(
        name='n',
        sources=(fold.Axis(path='n/scale'),),
        consumers=(fold.Axis(path='a/kernel'), fold.Axis(path='b/kernel')),
      ),
    )
  )
  st = LayerStats.from_activations(x)
  return x, params, fm, {'a/kernel': st, 'b/kernel': st}


@pytest.mark.parametrize('alpha', [0.0, 0.5, 0.85, 1.0])
def test_scale_formula_on_a_toy(alpha):
  x, params, fm, stats = _toy()
  s = smoothquant.group_scales(params, fm.groups[0], stats, alpha)
  xmax = np.abs(np.asarray(x)).max(0)
  w = np.concatenate([params['a']['kernel'], params['b']['kernel']], 1)
  wmax = np.abs(np.asarray(w)).max(1)  # Max over both consumers' rows.
  np.testing.assert_allclose(s, xmax**alpha / wmax ** (1 - alpha), rtol=1e-5)


def test_smooth_keeps_the_product_and_moves_the_outlier():
  x, params, fm, stats = _toy()
  q, new_stats, info = smoothquant.smooth(params, fm, stats, alpha=0.5)
  s = params['n']['scale'] / q['n']['scale']
  for k in ('a', 'b'):
    np.testing.assert_allclose(
      (x / s[None]) @ q[k]['kernel'],
      x @ params[k]['kernel'],
      rtol=1e-4,
      atol=1e-4,
    )
  np.testing.assert_allclose(
    new_stats['a/kernel'].absmax, stats['a/kernel'].absmax / s, rtol=1e-6
  )
  i = info['n']
  assert i['act_max_after'] < i['act_max_before'] / 3


def test_gqa_output_projection_gets_tied_scales():
  model = lms.stock(kv_heads=2)
  p = lms.stock_params(model)
  fm = stock_lm.fold_map(p, num_heads=4)
  g = next(g for g in fm.groups if g.name == 'blocks/0/v')
  x = jax.random.normal(jax.random.key(3), (32, 16))
  stats = {'blocks/0/o/kernel': LayerStats.from_activations(x)}
  s = smoothquant.group_scales(p, g, stats, 0.5)
  assert s.shape == (8,)  # kv_heads * head_dim
  ax = g.consumers[0]
  xmax = np.abs(np.asarray(x)).max(0).reshape(2, 2, 4).max(1).ravel()
  wmax = (
    np.abs(p['blocks'][0]['o']['kernel']).max(1).reshape(2, 2, 4).max(1).ravel()
  )
  np.testing.assert_allclose(s, np.sqrt(xmax / wmax), rtol=1e-5)
  assert fold.expand(s, ax).shape == (16,)


def test_smoothed_stock_lm_float_unchanged():
  model = _outlier_stock()
  p = lms.stock_params(model)
  fm = stock_lm.fold_map(p, num_heads=4)
  d = {'q': 16, 'k': 16, 'v': 16, 'o': 16, 'gate': 16, 'up': 16, 'down': 32}
  stats = {}
  for i, (name, n) in enumerate(d.items()):
    x = jax.random.normal(jax.random.key(i), (16, n))
    x = x * jnp.exp(jax.random.normal(jax.random.key(99 + i), (n,)))[None]
    stats[f'blocks/0/{name}/kernel'] = LayerStats.from_activations(x)
  smoothed, _, info = smoothquant.smooth(p, fm, stats, alpha=0.5)
  assert sorted(info) == sorted(g.name for g in fm.groups)
  x = lms.ids()
  np.testing.assert_allclose(
    lms.stock_with(model, smoothed)(x), model(x), rtol=1e-4, atol=1e-4
  )


@functools.cache
def _outlier_stock():
  model = lms.stock(kv_heads=2)
  p = lms.stock_params(model)
  q, _ = outliers.inject(p, stock_lm.fold_map(p, num_heads=4), channels=2)
  return lms.stock_with(model, q)


def test_quantize_smoothquant_stock_lm_float_unchanged_and_w8a8_better():
  model = _outlier_stock()
  batches = [lms.ids(i, batch=4) for i in range(2)]
  x = batches[0]
  ref = model(x)
  rules = [Rule(None, path='embed.*'), Rule(smoothquant.w8a8(), weight=True)]
  err = {}
  for method in ('rtn', 'smoothquant'):
    served, rep = aqtr.ptq.quantize(model, rules, batches, method=method)
    err[method] = float(jnp.abs(served(x) - ref).max())
    assert len(rep.layers) == 7
  assert err['smoothquant'] < err['rtn'] / 4, err
  # Real int8 x int8 dots in the served program (7 weight ops).
  jaxpr = jax.make_jaxpr(lambda ids: served(ids))(x).jaxpr
  assert _dots(jaxpr)[('int8', 'int8')] == 7, _dots(jaxpr)


def _dots(jaxpr) -> collections.Counter:
  """dot_general eqns by (lhs dtype, rhs dtype), sub-jaxprs included."""
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if is_dot(eqn):
      found[tuple(str(v.aval.dtype) for v in eqn.invars[:2])] += 1
    for inner in sub_jaxprs(eqn):
      found += _dots(inner)
  return found


def test_quantize_smoothquant_pax_lm():
  t, module, v = lms.pax()
  p, _ = outliers.inject(v, models.fold_map(v), channels=2)
  batches = [lms.ids(i, batch=4) for i in range(2)]
  rules = [Rule(smoothquant.w8a8('token'), weight=True)]
  (tmpl, served), rep = aqtr.ptq.quantize(
    t, rules, batches, variables=p, method=aqtr.ptq.SmoothQuant(alpha=0.6)
  )
  assert rep.method.alpha == 0.6 and len(rep.layers) == 7
  import fiddle as fdl

  out = fdl.build(tmpl).apply(served, batches[0])
  ref = module.apply(v, batches[0])
  assert float(jnp.abs(out - ref).max()) < 0.5


def test_w8a8_config():
  tensor, token = smoothquant.w8a8(), smoothquant.w8a8('token')
  assert type(tensor.fwd.lhs.tiling).__name__ == 'PerTensor'
  assert tensor.fwd.lhs.numerics.bits == 8 and tensor.fwd.rhs.numerics.bits == 8
  assert token.fwd.lhs == aqtr.presets.int8_fwd().fwd.lhs
  with pytest.raises(
    ValueError, match="activations must be one of \\('tensor', 'token'\\)"
  ):
    smoothquant.w8a8('channel')


def test_bad_alpha_one_line():
  for bad in (-0.1, 1.5, float('nan'), '0.5', True):
    with pytest.raises(
      ValueError,
      match='SmoothQuant.alpha: alpha must be a number in \\[0, 1\\]',
    ):
      aqtr.ptq.SmoothQuant(alpha=bad)
  with pytest.raises(
    TypeError, match='fold_map must be an aqtr.ptq.fold.FoldMap'
  ):
    aqtr.ptq.SmoothQuant(fold_map={'groups': ()})
  assert aqtr.ptq.methods.get('smoothquant', alpha=0.7).alpha == 0.7
  assert dataclasses.is_dataclass(aqtr.ptq.SmoothQuant())


def test_missing_stats_one_line():
  _, params, fm, _ = _toy()
  with pytest.raises(
    KeyError, match='no calibration stats for any of its consumers'
  ):
    smoothquant.group_scales(params, fm.groups[0], {}, 0.5)


def test_quantize_smoothquant_linen_user_fold_map():
  import flax.linen as nn

  class Mlp(nn.Module):  # stock linen: LayerNorm feeding two Dense
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm(name='norm')(x)
      return nn.Dense(8, name='a')(h) + nn.Dense(8, name='b')(h)

  model = Mlp()
  xs = [jax.random.normal(jax.random.key(i), (32, 16)) for i in range(2)]
  v = model.init(jax.random.key(0), xs[0])
  ax = fold.Axis
  fm = fold.FoldMap(
    groups=(
      fold.FoldGroup(
        name='norm',
        sources=(ax(path='params/norm/scale'), ax(path='params/norm/bias')),
        consumers=(ax(path='params/a/kernel'), ax(path='params/b/kernel')),
      ),
    )
  )
  v, _ = outliers.inject(v, fm, channels=2)
  ref = model.apply(v, xs[0])
  rules = [Rule(smoothquant.w8a8())]
  err = {}
  for method in ('rtn', aqtr.ptq.SmoothQuant(fold_map=fm)):
    (module, sv), rep = aqtr.ptq.quantize(
      model, rules, xs, variables=v, method=method
    )
    out = module.apply(sv, xs[0])
    err[rep.method.name] = float(jnp.abs(out - ref).max())
  assert err['smoothquant'] < err['rtn'] / 4, err
