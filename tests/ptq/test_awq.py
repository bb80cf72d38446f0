"""AWQ: never worse than RTN, alpha = 0 is RTN, clips help, bad input."""

import dataclasses

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
import aqtr.ptq
from aqtr.ptq import awq, fold, outliers
from aqtr.ptq.stats import LayerStats, as_matrix, output_error
from aqtr.rules import Rule
from aqtr.tilings.subchannel import SubChannel
from aqtr.train import models, stock_lm

from . import lms

W4 = aqtr.presets.int4_weight_only().fwd.rhs


def _grouped(cfg, tile):
  return dataclasses.replace(cfg, tiling=SubChannel(tile_size=tile))


def _toy(d_in=32, d_out=16, outliers_at=(3, 17), seed=0):
  """A norm feeding two weights; a few input channels 30-60x larger."""
  k = jax.random.split(jax.random.key(seed), 3)
  big = jnp.ones(d_in).at[jnp.array(outliers_at)].set(jnp.array([30.0, 60.0]))
  x = jax.random.normal(k[0], (256, d_in)) * big[None]
  params = {
    'n': {'scale': jnp.ones(d_in)},
    'a': {'kernel': jax.random.normal(k[1], (d_in, d_out))},
    'b': {'kernel': jax.random.normal(k[2], (d_in, 8))},
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


def _effective_error(x, params, new, cfg):
  """||X W - (X / s) Q(W')||^2 summed over both consumers."""
  s = params['n']['scale'] / new['n']['scale']
  total = 0.0
  for k in ('a', 'b'):
    q = awq.rtn(new[k]['kernel'], cfg, 0)
    total += float(jnp.sum(((x / s[None]) @ q - x @ params[k]['kernel']) ** 2))
  return total


@pytest.mark.parametrize('cfg', [W4, _grouped(W4, 16)], ids=['w4', 'w4g16'])
def test_awq_error_below_rtn_on_outliers(cfg):
  x, params, fm, stats = _toy()
  cfgs = {'a/kernel': cfg, 'b/kernel': cfg}
  new, _, info = awq.solve(params, fm, stats, cfgs, awq.Awq(clip=False))
  rtn = _effective_error(x, params, params, cfg)
  got = _effective_error(x, params, new, cfg)
  assert info['n']['alpha'] > 0
  assert got < 0.7 * rtn, (got, rtn)
  np.testing.assert_allclose(info['n']['rtn_error'], rtn, rtol=1e-3)
  np.testing.assert_allclose(info['n']['error'], got, rtol=1e-3)
  # The fold keeps the float product.
  s = params['n']['scale'] / new['n']['scale']
  np.testing.assert_allclose(
    (x / s[None]) @ new['a']['kernel'], x @ params['a']['kernel'], rtol=1e-3
  )


def test_clip_search_never_worse_and_helps():
  _, params, fm, stats = _toy()
  cfg = _grouped(W4, 16)
  cfgs = {'a/kernel': cfg, 'b/kernel': cfg}
  _, _, plain = awq.solve(params, fm, stats, cfgs, awq.Awq(clip=False))
  _, _, clip = awq.solve(params, fm, stats, cfgs, awq.Awq())
  assert clip['n']['error'] < plain['n']['error']
  w = params['a']['kernel']
  ratios = jnp.asarray(awq.Awq().ratios)
  wc, before, after = awq.clip_search(
    w, stats['a/kernel'].xtx, ratios, cfg=cfg, axis=0, group=16
  )
  assert float(after) <= float(before)
  assert float(jnp.max(jnp.abs(wc))) <= float(jnp.max(jnp.abs(w)))


def test_alpha_zero_without_clip_is_rtn():
  x, params, fm, stats = _toy()
  cfgs = {'a/kernel': W4, 'b/kernel': W4}
  method = awq.Awq(alphas=(0.0,), clip=False)
  new, _, info = awq.solve(params, fm, stats, cfgs, method)
  for k in ('n', 'a', 'b'):
    leaf = 'scale' if k == 'n' else 'kernel'
    assert (new[k][leaf] == params[k][leaf]).all()
  assert info['n']['error'] == info['n']['rtn_error']
  del x


def test_duo_scaling_below_rtn():
  _, params, fm, stats = _toy()
  cfgs = {'a/kernel': W4, 'b/kernel': W4}
  _, _, info = awq.solve(params, fm, stats, cfgs, awq.Awq(duo=True, clip=False))
  assert info['n']['error'] < info['n']['rtn_error']
  w = awq.weight_mean(params['a']['kernel'], W4, fm.groups[0].consumers[0])
  assert w.shape == (32,) and float(w.max()) <= 1.0


def test_no_better_alpha_keeps_rtn():
  _, params, fm, _ = _toy()
  # Every input channel matters alike (xtx = I) but mean|x| says channel 0
  # dominates: scaling it up only coarsens the other rows' grid.
  m = jnp.ones(32).at[0].set(1000.0)
  st = LayerStats(jnp.eye(32), m, m, jnp.asarray(1.0))
  stats = {'a/kernel': st, 'b/kernel': st}
  cfgs = {'a/kernel': W4, 'b/kernel': W4}
  method = awq.Awq(alphas=(0.5, 1.0), clip=False)
  new, _, info = awq.solve(params, fm, stats, cfgs, method)
  assert np.isnan(info['n']['alpha'])
  assert (new['n']['scale'] == params['n']['scale']).all()
  assert info['n']['error'] == info['n']['rtn_error']


def test_any_registered_numerics():
  x, params, fm, stats = _toy()
  cfg = aqtr.presets.nvfp4().fwd.rhs
  new, _, info = awq.solve(
    params, fm, stats, {'a/kernel': cfg, 'b/kernel': cfg}, awq.Awq()
  )
  assert info['n']['error'] <= info['n']['rtn_error']
  del x, new


def test_scales_normalised():
  m = jnp.array([0.5, 2.0, 8.0])
  s = awq.scales(m, 0.5)
  np.testing.assert_allclose(float(jnp.max(s) * jnp.min(s)), 1.0, rtol=1e-6)
  assert (awq.scales(m, 0.0) == 1.0).all()


def test_quantize_awq_pax_lm_beats_rtn_on_outliers():
  t, module, v = lms.pax()
  p, _ = outliers.inject(v, models.fold_map(v), channels=2)
  batches = [lms.ids(i, batch=4) for i in range(2)]
  rules = [Rule(aqtr.presets.int4_weight_only(), weight=True)]
  x = lms.ids(7, batch=4)
  ref = module.apply(v, x)
  err = {}
  awq_method = aqtr.ptq.Awq(alphas=(0.0, 0.25, 0.5, 0.75), clip=False)
  for method in ('rtn', awq_method):
    (tmpl, served), rep = aqtr.ptq.quantize(
      t, rules, batches, variables=p, method=method
    )
    out = fdl.build(tmpl).apply(served, x)
    err[rep.method.name] = float(jnp.mean((out - ref) ** 2))
  assert err['awq'] < 0.5 * err['rtn'], err


def test_awq_stock_lm_gqa_keeps_float_and_lowers_error():
  model = lms.stock(kv_heads=2)
  p = lms.stock_params(model)
  fm = stock_lm.fold_map(p, num_heads=4)
  d = {'q': 16, 'k': 16, 'v': 16, 'o': 16, 'gate': 16, 'up': 16, 'down': 32}
  stats = {}
  for i, (name, n) in enumerate(d.items()):
    x = jax.random.normal(jax.random.key(i), (64, n))
    x = x * jnp.exp(2 * jax.random.normal(jax.random.key(50 + i), (n,)))[None]
    stats[f'blocks/0/{name}/kernel'] = LayerStats.from_activations(x)
  cfgs = {k: W4 for k in stats}
  method = awq.Awq(alphas=(0.0, 0.5), clip=False)
  new, _, info = awq.solve(p, fm, stats, cfgs, method)
  assert sorted(info) == sorted(g.name for g in fm.groups)
  assert all(v['error'] <= v['rtn_error'] for v in info.values())
  o = new['blocks'][0]['o']['kernel'] / p['blocks'][0]['o']['kernel']
  assert np.allclose(o[:4], o[4:8])  # One scale per v channel, 2 groups.
  x = lms.ids()
  np.testing.assert_allclose(
    lms.stock_with(model, new)(x), model(x), rtol=1e-4, atol=1e-4
  )


def test_bad_fields_one_line():
  bad = [
    ({'alphas': ()}, ValueError, 'Awq.alphas must be a non-empty tuple'),
    ({'alphas': (0.5, 1.5)}, ValueError, r'Awq.alphas: 1.5 is not .* \[0, 1\]'),
    ({'alphas': [0.5]}, ValueError, 'Awq.alphas must be a non-empty tuple'),
    ({'clip_grid': 0}, ValueError, 'Awq.clip_grid must be an int >= 1'),
    ({'max_shrink': 1.0}, ValueError, r'Awq.max_shrink must be in \[0, 1\)'),
    ({'clip': 1}, TypeError, 'Awq.clip must be a bool'),
    ({'duo': 'yes'}, TypeError, 'Awq.duo must be a bool'),
    ({'fold_map': 'stock'}, TypeError, 'Awq.fold_map must be'),
  ]
  for kw, err, msg in bad:
    with pytest.raises(err, match=msg):
      aqtr.ptq.Awq(**kw)


def test_stochastic_rounding_config_one_line():
  _, params, fm, stats = _toy()
  cfg = dataclasses.replace(W4, rounding=aqtr.Stochastic())
  with pytest.raises(
    ValueError, match="'a/kernel' rounds its weight stochastically"
  ):
    awq.solve(params, fm, stats, {'a/kernel': cfg}, awq.Awq())


def test_tile_not_dividing_names_the_weight():
  _, params, fm, stats = _toy()
  cfgs = {'a/kernel': _grouped(W4, 24), 'b/kernel': W4}
  with pytest.raises(ValueError, match='awq: a/kernel: .*tile_size=24'):
    awq.solve(params, fm, stats, cfgs, awq.Awq())


def test_missing_stats_one_line():
  _, params, fm, _ = _toy()
  with pytest.raises(
    KeyError, match="no calibration stats for consumer of 'n' 'a/kernel'"
  ):
    awq.solve(params, fm, {}, {'a/kernel': W4}, awq.Awq())


def test_output_error_is_the_objective():
  x, params, _, stats = _toy()
  w = params['a']['kernel']
  dw = awq.rtn(w, W4, 0) - w
  np.testing.assert_allclose(
    float(output_error(as_matrix(dw, (0,)), stats['a/kernel'].xtx)),
    float(jnp.sum((x @ dw) ** 2)),
    rtol=1e-4,
  )
