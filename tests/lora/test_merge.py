"""merge (adapters folded into re-quantized weights) and sizes (bytes)."""

from __future__ import annotations

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.ptq
from aqtr import lora
from aqtr.flax.frozen import is_compact, is_holder
from aqtr.lora.requant import BaseGrid, requantized
from aqtr.train import models

X = jax.random.normal(jax.random.key(1), (4, 128))


def _lora(base, dq=False, rank=4, seed=2):
  m = lora.attach(
    nnx.Linear(128, 64, rngs=nnx.Rngs(0)),
    lora.LoraConfig(rank=rank, base=base, double_quant=dq),
    X,
  )
  b = m.lora_b_dot_general0
  b.set_value(
    0.02 * jax.random.normal(jax.random.key(seed), b.get_value().shape)
  )
  return m


@pytest.mark.parametrize(
  'base, dq', [('nf4', False), ('nf4', True), ('int8_weight_only', False)]
)
def test_zero_adapters_merge_to_the_same_frozen_base(base, dq):
  m = _lora(base, dq)
  m.lora_b_dot_general0.set_value(jnp.zeros((4, 64)))
  merged = lora.merge(m, X)
  assert is_holder(merged.kernel) and not is_compact(merged.kernel)
  assert not hasattr(merged, 'lora_a_dot_general0')
  if base == 'nf4':  # the block max is +-1 * scale: re-quantized exactly
    np.testing.assert_array_equal(merged(X), m(X))
  else:  # 127 * s / 127 may round the scale by an ulp
    np.testing.assert_allclose(merged(X), m(X), rtol=1e-5, atol=1e-5)


def test_float_base_merges_exactly_up_to_rounding():
  m = _lora(None)
  merged = lora.merge(m, X)
  assert isinstance(merged.kernel, nnx.Param)
  np.testing.assert_allclose(merged(X), m(X), atol=1e-5)


@pytest.mark.parametrize('base', ['nf4', 'int8_weight_only'])
def test_merged_is_requantized_close_to_unmerged(base):
  m = _lora(base)
  y, merged = m(X), lora.merge(m, X)(X)
  err = float(jnp.abs(merged - y).mean() / jnp.abs(y).mean())
  assert 0 < err < (0.15 if base == 'nf4' else 0.01)


def test_merge_other_adapters_and_their_shape_check():
  m, other = _lora('nf4'), _lora('nf4', seed=5)
  mine = lora.merge(m, X)(X)
  theirs = lora.merge(m, X, adapters=nnx.state(other, lora.Adapter))(X)
  np.testing.assert_array_equal(theirs, lora.merge(other, X)(X))
  assert not np.array_equal(mine, theirs)
  wrong = nnx.state(_lora('nf4', rank=8), lora.Adapter)
  with pytest.raises(
    ValueError,
    match=r"adapter 'lora_a_dot_general0' has shape \(128, 8\) but the "
    r'model needs \(128, 4\) \(rank 4\)',
  ) as e:
    lora.merge(m, X, adapters=wrong)
  assert '\n' not in str(e.value)
  with pytest.raises(
    ValueError, match="the adapters have no 'lora_b_dot_general0'"
  ):
    lora.merge(m, X, adapters={'lora_a_dot_general0': jnp.zeros((128, 4))})


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))


def test_linen_merge():
  model = _Mlp()
  v = model.init(jax.random.key(0), X)
  lm, lv = lora.attach(
    model, lora.LoraConfig(rank=4, base='nf4'), X, variables=v
  )
  sm, sv = lora.merge(lm, X, variables=lv)
  np.testing.assert_array_equal(sm.apply(sv, X), lm.apply(lv, X))
  assert 'lora_a_dot_general0' not in sv['params']['Dense_0']


def test_sizes_bytes_of_each_part():
  x = X[:, :64]
  m = lora.attach(
    nnx.Linear(64, 256, use_bias=False, rngs=nnx.Rngs(0)),
    lora.LoraConfig(rank=4, base='nf4'),
    x,
  )
  s = lora.sizes(m, x)
  assert s.adapters == 4 * (64 * 4 + 4 * 256)
  assert s.optimizer == 2 * s.adapters
  assert s.base_float == 4 * 64 * 256
  assert s.base == 64 * 256 // 2 + 4 * 256  # 4-bit codes + a scale per 64
  assert s.base_bits == 4.5 and s.other == 0
  assert s.full == 3 * s.base_float
  dq = lora.sizes(
    lora.attach(
      nnx.Linear(64, 256, use_bias=False, rngs=nnx.Rngs(0)),
      lora.LoraConfig(rank=4, base='nf4', double_quant=True),
      x,
    ),
    x,
  )
  assert dq.base == 64 * 256 // 2 + 256 + 4 + 4  # int8 scales, c, mean
  assert dq.ratio < s.ratio < 0.25


XS = [jax.random.normal(jax.random.key(10 + i), (32, 128)) for i in range(2)]
XC = jnp.concatenate(XS)


def _err(served, m):
  y = m(XC)
  return float(jnp.mean((served(XC) - y) ** 2) / jnp.mean(y**2))


def _parts(served):
  (entry,) = served.kernel.entries()['dot_general0_rhs'].values()
  return entry['rhs']


@pytest.mark.parametrize('grid', ['fresh', 'base'])
def test_gptq_merge_serves_the_base_format_closer_than_rtn(grid):
  m = _lora('nf4')
  rtn = lora.merge(m, X, grid=grid)
  got, rep = lora.merge(m, X, method='gptq', batches=XS, grid=grid, report=True)
  assert is_holder(got.kernel) and not is_compact(got.kernel)
  assert not hasattr(got, 'lora_a_dot_general0')
  want = _parts(rtn)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), _parts(got)) == (
    jax.tree.map(lambda a: (a.shape, a.dtype), want)
  )
  assert _err(got, m) < _err(rtn, m)  # on the calibration inputs
  (layer,) = rep.layers
  assert layer.tokens == 64 and layer.error < layer.rtn_error
  if grid == 'base':  # the base's scales, not the merged weight's
    np.testing.assert_array_equal(_parts(got)['scale'], want['scale'])


def test_base_grid_keeps_the_base_scales():
  m = _lora('nf4')
  base = _parts(lora.merge(m, X, adapters=_zero_adapters(m)))
  fresh, kept = _parts(lora.merge(m, X)), _parts(lora.merge(m, X, grid='base'))
  np.testing.assert_array_equal(kept['scale'], base['scale'])
  assert not np.array_equal(fresh['scale'], base['scale'])


def _zero_adapters(m):
  return jax.tree.map(
    jnp.zeros_like, nnx.to_pure_dict(nnx.state(m, lora.Adapter))
  )


def test_rtn_through_ptq_is_todays_merge():
  m = _lora('nf4')
  np.testing.assert_array_equal(
    lora.merge(m, X, batches=XS)(X), lora.merge(m, X)(X)
  )


def test_linen_gptq_merge():
  model = _Mlp()
  v = model.init(jax.random.key(0), X)
  lm, lv = lora.attach(
    model, lora.LoraConfig(rank=4, base='nf4'), X, variables=v
  )
  sm, sv = lora.merge(lm, X, variables=lv, method='gptq', batches=XS)
  assert sm.apply(sv, X).shape == (4, 8)
  assert 'lora_a_dot_general0' not in sv['params']['Dense_0']


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (
      {'method': 'gptq'},
      r"method='gptq' needs batches= \(calibration inputs of the "
      r"fine-tuning domain\); only method='rtn' needs none",
    ),
    ({'report': True}, r'report=True needs batches='),
    (
      {'method': 'nope', 'batches': XS},
      r"method must be one of \['awq', 'gptq', 'rtn', 'smoothquant'\] or "
      r"an aqtr.ptq.Method, got 'nope'",
    ),
    (
      {'method': 'gptq', 'batches': XS, 'requantize': None},
      r'the merged weights are float \(requantize=None\): there is nothing '
      r"for method='gptq'",
    ),
    (
      {'grid': 'base', 'requantize': 'int8_weight_only'},
      r"grid='base' keeps the base's scales, so it needs requantize='base'",
    ),
    (
      {'method': 'gptq', 'batches': XS, 'grid': 'base', 'requantize': None},
      r'the merged weights are float \(requantize=None\): there is nothing '
      r"for method='gptq' / grid='base'",
    ),
    ({'grid': 'old'}, r"grid must be 'fresh' or 'base', got 'old'"),
    (
      {'method': 'awq', 'batches': XS, 'grid': 'base'},
      r"BaseGrid.then must solve on a given grid: 'rtn' or 'gptq'",
    ),
  ],
)
def test_bad_solver_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match) as e:
    lora.merge(_lora('nf4'), X, **kwargs)
  assert '\n' not in str(e.value)


def test_a_pax_template_needs_its_variables():
  with pytest.raises(TypeError, match='a Pax template needs variables='):
    lora.merge(fdl.Config(dict), X, grid='base')


def test_a_float_base_has_nothing_to_solve():
  m = _lora(None)
  with pytest.raises(
    ValueError, match=r'the merged weights are float \(float bases\)'
  ):
    lora.merge(m, X, method='gptq', batches=XS)
  solved = lora.merge(m, X, method='gptq', batches=XS, requantize='nf4')
  assert is_holder(solved.kernel) and not is_compact(solved.kernel)


def test_base_grid_refuses_a_solver_that_makes_its_own_grid():
  with pytest.raises(ValueError, match='BaseGrid.then must solve on a given'):
    BaseGrid(then=aqtr.ptq.Gptq(static_groups=False))


def test_requantized_checks_its_own_arguments():
  with pytest.raises(ValueError, match=r"method='gptq' needs batches="):
    requantized(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), [], method='gptq')


@pytest.mark.slow  # ~7 s: a Pax LM's GPTQ (aqtr.ptq's own Pax tests run it)
def test_requantized_serves_a_pax_template():
  t = models.lm(
    vocab_size=64, seq_len=16, d_model=32, num_layers=1, num_heads=2
  )
  ids = [
    jax.random.randint(jax.random.key(i), (4, 16), 0, 64) for i in range(2)
  ]
  v = models.build(t).init(jax.random.key(1), ids[0])
  rules = [
    aqtr.pax.Rule(aqtr.presets.int8_weight_only(), tag=aqtr.pax.tags.WeightOp)
  ]
  (tmpl, sv), rep = requantized(
    t, rules, ids[0], variables=v, method='gptq', batches=ids
  )
  assert len(rep.layers) == 7
  assert all(r.error <= r.rtn_error for r in rep.layers)
  y = jax.jit(models.build(tmpl).apply)(sv, ids[0])
  assert y.shape == (4, 16, 64) and bool(jnp.isfinite(y).all())
