"""LoRA on aqtr.pax templates: Fiddle-injected adapters, frozen bases."""

from __future__ import annotations

import warnings
from typing import Annotated

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import aqtr
import aqtr.pax
import aqtr.ptq
from aqtr import lora
from aqtr.flax.frozen import is_removed
from aqtr.lora import pax_merge, pax_op
from aqtr.lora.config import base_config
from aqtr.train import models

X = (jnp.arange(16).reshape(2, 8) * 7) % 64
LAYERS = r'layers.*'


@pytest.fixture(scope='module')
def lm():
  t = models.lm(64, 8, d_model=64, num_layers=1, num_heads=2, mlp_ratio=2)
  return t, jax.jit(fdl.build(t).init)(jax.random.key(0), X)


def _apply(template, variables, x=X):
  return jax.jit(fdl.build(template).apply)(variables, x)


def _with_b(variables, seed=3):
  """Variables whose B matrices are random (a trained-like adapter)."""
  adapters, frozen = lora.partition(variables['params'])
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  adapters = jax.tree.map(
    lambda a: 0.05 * jax.random.normal(next(keys), a.shape), adapters
  )
  return dict(variables, params=lora.combine(adapters, frozen))


@pytest.mark.parametrize('base', [None, 'nf4', 'int8_weight_only'])
def test_zero_b_is_the_base_model(lm, base):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, base=base)
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  if base is None:
    want = _apply(t, v)
  else:
    rule = aqtr.rules.Rule(base_config(base), path=LAYERS, weight=True)
    it, _ = aqtr.pax.inject(t, [rule])
    want = _apply(it, v)
  np.testing.assert_array_equal(_apply(lt, lv), want)
  wi = lv['params']['layers_0']['ffn']['wi']
  assert wi['einsum']['lora_a_einsum'].shape == (64, 4)
  assert wi['einsum']['lora_b_einsum'].shape == (4, 128)
  assert 'lora_a_einsum' not in lv['params']['softmax'].get('einsum', {})


def test_qlora_base_has_no_float_kernel_and_is_4_bit(lm):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, base='nf4', double_quant=True)
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  wi = lv['params']['layers_0']['ffn']['wi']
  assert is_removed(wi['kernel'])
  (entry,) = lv['aqtr']['layers_0']['ffn']['wi']['einsum'].values()
  assert entry['rhs']['table4'].dtype == jnp.uint8  # 4-bit codes, packed.
  assert entry['rhs']['scale8']['q'].dtype == jnp.int8
  plain = lora.attach(t, {LAYERS: lora.LoraConfig(base='nf4')}, X, variables=v)
  np.testing.assert_allclose(_apply(lt, lv), _apply(*plain), atol=0.02)
  s = lora.sizes(lt, X, variables=lv)
  nodq = lora.sizes(plain[0], X, variables=plain[1])
  assert 4.0 < s.base_bits < nodq.base_bits <= 4.5 + 1e-6
  a_b = sum(
    x.size * 4 for x in jax.tree.leaves(lora.partition(lv['params'])[0])
  )
  assert s.adapters == a_b and s.optimizer == 2 * a_b
  assert s.ratio < 0.5


def test_adapters_train_alone_and_serve_as_trained(lm):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, base='nf4', double_quant=True)
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  model = fdl.build(lt)
  adapters, frozen = lora.partition(lv['params'])
  tx = optax.adam(1e-2)
  opt = tx.init(adapters)
  y = jnp.roll(X, -1, axis=1)

  def loss(a):
    logits = model.apply(dict(lv, params=lora.combine(a, frozen)), X)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(a, o):
    value, g = jax.value_and_grad(loss)(a)
    upd, o = tx.update(g, o, a)
    return optax.apply_updates(a, upd), o, value

  first = None
  for _ in range(12):
    adapters, opt, value = step(adapters, opt)
    first = value if first is None else first
  assert float(jax.jit(loss)(adapters)) < 0.8 * float(first)
  trained = dict(lv, params=lora.combine(adapters, frozen))
  f = jax.jit(model.apply)
  np.testing.assert_array_equal(f(trained, X), f(trained, X))
  assert jax.tree.all(
    jax.tree.map(lambda a, b: bool((a == b).all()), lv['aqtr'], trained['aqtr'])
  )


@pytest.mark.parametrize(
  'base',
  [None, pytest.param('int8_weight_only', marks=pytest.mark.slow), 'nf4'],
)
def test_merge_folds_the_adapters_in(lm, base):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, base=base, double_quant=base == 'nf4')
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  lv = _with_b(lv)
  want = _apply(lt, lv)
  ft, fv, *_ = pax_merge.float_merged(lt, X, variables=lv)
  np.testing.assert_allclose(_apply(ft, fv), want, atol=2e-5)
  mt, mv = lora.merge(lt, X, variables=lv)
  got = _apply(mt, mv)
  base_gap = float(jnp.abs(_apply(lt, _with_b(lv, 0)) - want).max())
  if base is None:
    np.testing.assert_allclose(got, want, atol=2e-5)
  elif base == 'int8_weight_only':
    assert float(jnp.abs(got - want).max()) < 0.05
    (entry,) = mv['aqtr']['layers_0']['ffn']['wi']['einsum'].values()
    assert entry['rhs']['qvalue'].dtype == jnp.int8
  else:  # nf4: a fresh rounding, far closer than other adapters.
    assert float(jnp.abs(got - want).max()) < 0.5 * base_gap
  fl = lora.merge(lt, X, variables=lv, requantize=None)
  np.testing.assert_allclose(_apply(*fl), want, atol=2e-5)


def test_merge_with_gptq_uses_calibration_batches(lm):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, base='nf4')
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  lv = _with_b(lv)
  batches = [(jnp.arange(64).reshape(8, 8) * (i + 3)) % 64 for i in range(4)]
  want = _apply(lt, lv, batches[0])

  def err(tv):
    return float(jnp.mean((_apply(*tv, batches[0]) - want) ** 2))

  rtn = lora.merge(lt, X, variables=lv)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    solved, rep = lora.merge(
      lt,
      X,
      variables=lv,
      method=aqtr.ptq.Gptq(act_order=True),
      grid='base',
      batches=batches,
      report=True,
    )
  assert err(solved) < err(rtn)
  assert len(rep.layers) == 6
  # grid='base': the merged weights keep the base's scales.
  (b,) = lv['aqtr']['layers_0']['ffn']['wi']['einsum'].values()
  (m,) = solved[1]['aqtr']['layers_0']['ffn']['wi']['einsum'].values()
  np.testing.assert_allclose(m['rhs']['scale'], b['rhs']['scale'], rtol=1e-6)
  with pytest.raises(ValueError, match='needs batches='):
    lora.merge(lt, X, variables=lv, method='gptq')


def test_dropout_only_inside_its_context(lm):
  t, v = lm
  cfg = lora.LoraConfig(rank=4, dropout=0.5)
  lt, lv = lora.attach(t, {LAYERS: cfg}, X, variables=v)
  lv = _with_b(lv)
  f = fdl.build(lt).apply
  plain = f(lv, X)
  with lora.dropout(jax.random.key(0)):
    dropped = f(lv, X)
  assert not np.allclose(plain, dropped)
  np.testing.assert_array_equal(plain, f(lv, X))


@pytest.mark.parametrize(
  ('rules', 'match'),
  [
    ({'nowhere': lora.LoraConfig()}, 'matches no weight op'),
    (
      {r'.*qk_einsum': lora.LoraConfig()},
      'only ops without a weight operand',
    ),
    ({LAYERS: lora.LoraConfig(rank=65)}, 'exceeds min'),
  ],
)
def test_bad_rules_one_clear_line(lm, rules, match):
  t, v = lm
  with pytest.raises(ValueError, match=match) as e:
    lora.attach(t, rules, X, variables=v)
  assert '\n' not in str(e.value)


def test_bad_templates_and_adapters(lm):
  t, v = lm
  q, _ = aqtr.pax.inject(t, {LAYERS: 'int8'})
  with pytest.raises(ValueError, match='already has a config'):
    lora.attach(q, {LAYERS: lora.LoraConfig()}, X, variables=v)
  with pytest.raises(TypeError, match='needs variables='):
    lora.attach(t, {LAYERS: lora.LoraConfig()}, X)
  lt, lv = lora.attach(t, {LAYERS: lora.LoraConfig(rank=4)}, X, variables=v)
  _, other = lora.attach(t, {LAYERS: lora.LoraConfig(rank=2)}, X, variables=v)
  with pytest.raises(ValueError, match='same rank and shapes'):
    lora.merge(lt, X, variables=lv, adapters=lora.partition(other['params'])[0])
  with pytest.raises(ValueError, match=r'adapter lora_a_einsum has shape'):
    jax.eval_shape(fdl.build(lt).apply, dict(lv, params=other['params']), X)


def test_lora_op_is_a_pax_op():
  assert issubclass(pax_op.LoraEinsum, aqtr.pax.EinsumOp)
  assert issubclass(pax_op.LoraEinsum, nn.Module)


class Transposed(nn.Module):
  """A layer whose weight op reads its kernel transposed (derived)."""

  einsum: Annotated[aqtr.pax.EinsumOp | None, aqtr.pax.tags.WeightOp] = None

  @nn.compact
  def __call__(self, x):
    w = self.param('kernel', nn.initializers.lecun_normal(), (4, x.shape[-1]))
    return aqtr.pax.ops.einsum(self.einsum, '...d,df->...f', x, w.T)


def test_a_derived_weight_takes_no_adapter():
  t = fdl.Config(Transposed, einsum=fdl.Config(aqtr.pax.EinsumOp))
  x = jnp.ones((2, 8))
  v = jax.jit(fdl.build(t).init)(jax.random.key(0), x)
  with pytest.raises(ValueError, match='not a parameter of the layer') as e:
    lora.attach(t, {'.*': lora.LoraConfig(rank=2)}, x, variables=v)
  assert '\n' not in str(e.value)
