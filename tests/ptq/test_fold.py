"""Fold maps: the float rewrite leaves the models' outputs unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.ptq import fold, outliers
from aqtr.ptq.stats import LayerStats
from aqtr.train import models, stock_lm

from . import lms


def _random_scales(params, fold_map, seed=0):
  sizes = fold.check(params, fold_map)
  keys = jax.random.split(jax.random.key(seed), len(sizes))
  return {
    name: jnp.exp(jax.random.uniform(k, (n,), minval=-2.0, maxval=2.0))
    for k, (name, n) in zip(keys, sizes.items(), strict=True)
  }


def _fold_all(params, fold_map, scales):
  for g in fold_map.groups:
    params = fold.apply(params, g, scales[g.name])
  return params


@pytest.mark.parametrize('kv_heads', [4, 2])
def test_stock_lm_fold_keeps_outputs(kv_heads):
  model = lms.stock(kv_heads)
  p = lms.stock_params(model)
  fm = stock_lm.fold_map(p, num_heads=4)
  names = [g.name for g in fm.groups]
  assert names == [
    'blocks/0/attn_norm',
    'blocks/0/v',
    'blocks/0/mlp_norm',
    'blocks/0/up',
  ]
  assert fm.keep == ('embed/embedding',) and fm.unfolded == ()
  q = _fold_all(p, fm, _random_scales(p, fm))
  assert not np.allclose(
    q['blocks'][0]['q']['kernel'], p['blocks'][0]['q']['kernel']
  )
  x = lms.ids()
  want = model(x)
  got = lms.stock_with(model, q)(x)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_stock_lm_gqa_without_heads_leaves_o_unfolded():
  p = lms.stock_params(lms.stock(kv_heads=2))
  fm = stock_lm.fold_map(p)
  assert 'blocks/0/v' not in [g.name for g in fm.groups]
  assert fm.unfolded == ('blocks/0/o/kernel',)


@pytest.mark.parametrize('gated', [False, True])
def test_pax_lm_fold_keeps_outputs(gated):
  _, module, v = lms.pax(gated)
  fm = models.fold_map(v)
  names = [g.name for g in fm.groups]
  lay = 'params/layers_0'
  want_names = [f'{lay}/attention_norm', f'{lay}/attention/v_proj']
  want_names += [f'{lay}/ffn_norm'] + ([f'{lay}/ffn/wi'] if gated else [])
  assert names == [*want_names, 'params/final_norm']
  assert fm.unfolded == (() if gated else (f'{lay}/ffn/wo/kernel',))
  norm = fm.groups[0]
  assert [a.path.rsplit('/', 1)[1] for a in norm.sources] == ['scale', 'bias']
  q = _fold_all(v, fm, _random_scales(v, fm))
  x = lms.ids()
  np.testing.assert_allclose(
    module.apply(q, x), module.apply(v, x), rtol=2e-5, atol=2e-5
  )


def test_detect_picks_the_map():
  _, _, v = lms.pax()
  assert fold.detect(v) == models.fold_map(v)
  p = lms.stock_params(lms.stock(4))
  assert fold.detect(p) == stock_lm.fold_map(p)
  with pytest.raises(
    ValueError, match='no fold map known.*fold_map=aqtr.ptq.fold.FoldMap'
  ):
    fold.detect({'encoder': {}})


def test_outliers_inject_is_exact():
  model = lms.stock(2)
  p = lms.stock_params(model)
  fm = stock_lm.fold_map(p, num_heads=4)
  q, where = outliers.inject(p, fm, channels=3, seed=1)
  assert sorted(where) == ['blocks/0/attn_norm', 'blocks/0/mlp_norm']
  idx, f = where['blocks/0/attn_norm']
  scale = q['blocks'][0]['attn_norm']['scale']
  np.testing.assert_array_equal(
    scale[np.array(idx)],
    p['blocks'][0]['attn_norm']['scale'][np.array(idx)] * np.array(f),
  )
  x = lms.ids()
  assert (lms.stock_with(model, q)(x) == model(x)).all()


def test_outliers_inject_pax_is_exact():
  _, module, v = lms.pax()
  q, where = outliers.inject(v, models.fold_map(v), channels=2)
  assert len(where) == 3  # attention_norm, ffn_norm, final_norm
  x = lms.ids()
  assert (module.apply(q, x) == module.apply(v, x)).all()


def test_scale_stats_matches_scaled_activations():
  x = jax.random.normal(jax.random.key(0), (32, 4))
  s = jnp.array([1.0, 2.0, 0.5, 4.0])
  got = fold.scale_stats(LayerStats.from_activations(x), s)
  want = LayerStats.from_activations(x / s[None])
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_expand_and_reduce_follow_gqa_layout():
  ax = fold.Axis(path='o', repeat=2, inner=3)
  s = jnp.arange(6.0)  # [outer=2, inner=3]
  e = fold.expand(s, ax)
  assert e.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
  assert fold.reduce(e, ax, 'max').tolist() == s.tolist()
  assert fold.reduce(e, ax, 'mean').tolist() == s.tolist()


def _one_group(**consumer):
  return fold.FoldMap(
    groups=(
      fold.FoldGroup(
        name='g',
        sources=(fold.Axis(path='n/scale'),),
        consumers=(fold.Axis(**consumer),),
      ),
    )
  )


PARAMS = {'n': {'scale': jnp.ones(4)}, 'w': {'kernel': jnp.ones((4, 3))}}


def test_missing_parameter_one_line():
  with pytest.raises(
    KeyError, match="'w/kernl' does not exist.*has no 'kernl'.*kernel"
  ):
    fold.check(PARAMS, _one_group(path='w/kernl'))


def test_wrong_size_one_line():
  with pytest.raises(
    ValueError, match=r"'w/kernel' axis 1 has 3 entries, the group has 4"
  ):
    fold.check(PARAMS, _one_group(path='w/kernel', axis=1))


def test_bad_axis_and_fields():
  with pytest.raises(ValueError, match='no axis 2'):
    fold.check(PARAMS, _one_group(path='w/kernel', axis=2))
  with pytest.raises(ValueError, match='Axis.repeat must be an int >= 1'):
    fold.Axis(path='w', repeat=0)
  with pytest.raises(ValueError, match='sources and consumers'):
    fold.FoldGroup(name='g', sources=(fold.Axis(path='n/scale'),))
  with pytest.raises(ValueError, match='kind must be one of'):
    fold.FoldGroup(
      name='g',
      sources=(fold.Axis(path='a'),),
      consumers=(fold.Axis(path='b'),),
      kind='conv',
    )


def test_check_inputs_names_the_wrong_contraction():
  fm = _one_group(path='w/kernel')
  fold.check_inputs(PARAMS, fm, {'w/kernel': (0,)})
  with pytest.raises(
    ValueError, match=r'contracts axes \(1,\), the fold map says axis 0'
  ):
    fold.check_inputs(PARAMS, fm, {'w/kernel': (1,)})


def test_outliers_bad_input():
  fm = _one_group(path='w/kernel')
  with pytest.raises(ValueError, match='channels=5 exceeds the 4 channels'):
    outliers.inject(PARAMS, fm, channels=5)
  with pytest.raises(ValueError, match='channels must be an int >= 1'):
    outliers.inject(PARAMS, fm, channels=0)
  with pytest.raises(ValueError, match='factors must be positive finite'):
    outliers.inject(PARAMS, fm, factors=(0.0,))
