"""attach: adapters by rules on stock nnx / linen models, frozen bases."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr.flax
from aqtr import lora
from aqtr.flax.frozen import is_compact
from aqtr.lora.config import base_config
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(1), (3, 128))


def _linear():
  return nnx.Linear(128, 64, rngs=nnx.Rngs(0))


def _set_b(m, seed=2):
  b = m.lora_b_dot_general0
  b.set_value(
    0.1 * jax.random.normal(jax.random.key(seed), b.get_value().shape)
  )


@pytest.mark.parametrize('base', [None, 'nf4', 'int8_weight_only'])
def test_zero_b_is_the_base_and_delta_is_low_rank(base):
  m = _linear()
  lm = lora.attach(m, lora.LoraConfig(rank=4, base=base), X)
  if base is None:
    want = m(X)
  else:
    q = aqtr.flax.quantize(m, [Rule(base_config(base))])
    want = aqtr.flax.convert(q, X)(X)
  y0 = lm(X)
  np.testing.assert_array_equal(y0, want)
  _set_b(lm)
  a, b = lm.lora_a_dot_general0.get_value(), lm.lora_b_dot_general0.get_value()
  np.testing.assert_allclose(lm(X) - y0, X @ a @ b * 4.0, atol=2e-5)


def test_qlora_base_is_stored_compactly_with_no_float_kernel():
  cfg = lora.LoraConfig(rank=4, base='nf4', double_quant=True)
  lm = lora.attach(_linear(), cfg, X)
  assert is_compact(lm.kernel)
  (entry,) = lm.kernel.stored()['dot_general0_rhs'].values()
  parts = entry['rhs']
  assert parts['table4'].dtype == jnp.uint8  # Two 4-bit codes per byte.
  assert parts['table4'].size * 2 == 128 * 64
  assert parts['scale8']['q'].dtype == jnp.int8
  # No float array of the kernel's size anywhere in the model's state.
  for leaf in jax.tree.leaves(nnx.state(lm, nnx.Param)):
    assert leaf.size < 128 * 64 or leaf.dtype != jnp.float32


@pytest.mark.parametrize('dq', [False, True])
def test_serving_is_the_training_forward_bit_for_bit(dq):
  lm = lora.attach(
    _linear(), lora.LoraConfig(rank=4, base='nf4', double_quant=dq), X
  )
  _set_b(lm)
  graphdef, ad, rest = nnx.split(lm, lora.Adapter, ...)

  def forward(ad, rest):
    return nnx.merge(graphdef, ad, rest)(X)

  def loss(ad):
    return jnp.sum(forward(ad, rest) ** 2)

  grads = jax.jit(jax.grad(loss))(ad)
  # One SGD step, then the training forward and the served model agree.
  ad = jax.tree.map(lambda p, g: p - 0.1 * g, ad, grads)
  trained = jax.jit(forward)(ad, rest)
  nnx.update(lm, ad)
  served = nnx.jit(lambda m: m(X))(lm)
  np.testing.assert_array_equal(trained, served)
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(grads))
  assert shapes == {
    'lora_a_dot_general0': (128, 4),
    'lora_b_dot_general0': (4, 64),
  }


def test_base_grad_flows_through_the_frozen_op():
  """Earlier layers' adapters train: the frozen op passes dL/dx."""

  class Two(nnx.Module):
    def __init__(self):
      self.a = nnx.Linear(128, 64, rngs=nnx.Rngs(0))
      self.b = nnx.Linear(64, 64, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  lm = lora.attach(Two(), lora.LoraConfig(rank=4, base='nf4'), X)
  _set_b(lm.b)
  g = nnx.grad(
    lambda m: jnp.sum(m(X) ** 2), argnums=nnx.DiffState(0, lora.Adapter)
  )(lm)
  assert float(jnp.abs(g['a']['lora_b_dot_general0'].get_value()).max()) > 0


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.relu(nn.Dense(64)(x)), None


class _Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      _Layer,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=3,
    )
    return nn.Dense(8, name='head')(scan(name='layers')(x, None)[0])


def test_linen_scan_over_layers_stacks_the_adapters():
  x = X[:, :64]
  model = _Stack()
  v = model.init(jax.random.key(0), x)
  lm, lv = lora.attach(
    model, {'layers.*': lora.LoraConfig(rank=2, base='nf4')}, x, variables=v
  )
  p = lv['params']['layers']['Dense_0']
  assert p['lora_a_dot_general0'].shape == (3, 64, 2)
  assert p['lora_b_dot_general0'].shape == (3, 2, 64)
  assert is_compact(p['kernel'])
  assert 'lora_a_dot_general0' not in lv['params']['head']
  adapters, frozen = lora.partition(lv['params'])
  y0 = lm.apply(lv, x)

  def loss(ad):
    return jnp.sum(lm.apply({'params': lora.combine(ad, frozen)}, x) ** 2)

  g = jax.jit(jax.grad(loss))(adapters)
  assert g['layers']['Dense_0']['lora_b_dot_general0'].shape == (3, 2, 64)
  assert float(jnp.abs(g['layers']['Dense_0']['lora_b_dot_general0']).max())
  np.testing.assert_array_equal(jax.jit(lm.apply)(lv, x), y0)


def test_dropout_only_inside_its_context():
  cfg = lora.LoraConfig(rank=4, dropout=0.5)
  lm = lora.attach(_linear(), cfg, X)
  _set_b(lm)
  y = lm(X)
  np.testing.assert_array_equal(lm(X), y)
  with lora.dropout(jax.random.key(0)):
    yd = lm(X)
  assert not np.array_equal(yd, y)


def test_quantized_adapter_matmuls():
  lm = lora.attach(_linear(), lora.LoraConfig(rank=4, adapter='int8'), X)
  ref = lora.attach(_linear(), lora.LoraConfig(rank=4), X)
  _set_b(lm)
  _set_b(ref)
  d = np.abs(np.asarray(lm(X) - ref(X)))
  assert 0 < d.max() < 0.05


class _Attn(nnx.Module):
  def __init__(self):
    self.q = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    self.embed = nnx.Embed(16, 64, rngs=nnx.Rngs(1))

  def __call__(self, x):
    q = self.q(x)
    s = jnp.einsum('bd,cd->bc', q, x)
    return self.embed.attend(s @ x)


@pytest.mark.parametrize(
  'rules, match',
  [
    (
      {'nothing.*': lora.LoraConfig()},
      r"rule 0 .*path='nothing\.\*'.* matches no weight op",
    ),
    (
      [(Rule(path='', op='einsum'), lora.LoraConfig())],
      r'matches only ops without a weight operand',
    ),
    (
      [(Rule(weight=False), lora.LoraConfig())],
      r'adapters need a parameter: drop weight=False',
    ),
    (
      {'q': lora.LoraConfig(rank=65)},
      r'rank 65 exceeds min\(d_in, d_out\) = min\(64, 64\)',
    ),
    (
      {'embed': lora.LoraConfig()},
      r'derived from a parameter .* exclude this op',
    ),
    (
      [(Rule('int8'), lora.LoraConfig())],
      r'sets a config; the base format is LoraConfig.base',
    ),
  ],
)
def test_bad_rules_one_clear_line(rules, match):
  with pytest.raises(ValueError, match=match) as e:
    lora.attach(_Attn(), rules, X[:, :64])
  assert '\n' not in str(e.value)


def test_conv_weights_take_no_adapters():
  conv = nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='adapters go on dot_general / einsum'):
    lora.attach(
      conv,
      [(Rule(op='conv'), lora.LoraConfig(rank=2, base='int8'))],
      jnp.ones((1, 8, 8, 3)),
    )


def test_bad_rule_types():
  with pytest.raises(TypeError, match='rules must be a LoraConfig'):
    lora.attach(_linear(), 'nf4', X)
  with pytest.raises(
    TypeError, match=r'each rule must be a \(Rule, LoraConfig\)'
  ):
    lora.attach(_linear(), [lora.LoraConfig()], X)
  with pytest.raises(TypeError, match='a linen model needs variables='):
    lora.attach(_Stack(), lora.LoraConfig(), X)


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return x + jax.nn.relu(self.lin(x))


class _NnxStack(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _Block(rngs)

    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return body(x, self.blocks)


def test_nnx_scan_over_layers_stacks_the_adapters():
  x = X[:2, :64]
  m = _NnxStack(nnx.Rngs(0))
  lm = lora.attach(m, {'.*blocks.*': lora.LoraConfig(rank=4, base='nf4')}, x)
  assert lm.blocks.lin.lora_a_dot_general0.shape == (3, 64, 4)
  assert is_compact(lm.blocks.lin.kernel)
  q = aqtr.flax.quantize(m, [Rule(base_config('nf4'), path='.*blocks.*')])
  np.testing.assert_array_equal(lm(x), aqtr.flax.convert(q, x)(x))
  g = nnx.grad(
    lambda mm: jnp.sum(mm(x) ** 2), argnums=nnx.DiffState(0, lora.Adapter)
  )(lm)
  assert g['blocks']['lin']['lora_b_dot_general0'].shape == (3, 4, 64)
