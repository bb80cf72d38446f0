"""Stateful and learned calibrations through rules (Flax variables)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.flax
import aqtr.flax.nnx as qnnx
from aqtr.flax.frozen import is_holder
from aqtr.flax.rule_state import QuantState
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(1), (4, 8))
CFG = aqtr.presets.fp8_delayed(history_length=4)


class Mlp(nnx.Module):
  def __init__(self, dg=None):
    kw = {} if dg is None else {'dot_general': dg()}
    self.up = nnx.Linear(8, 16, rngs=nnx.Rngs(0), **kw)
    kw = {} if dg is None else {'dot_general': dg()}
    self.down = nnx.Linear(16, 8, rngs=nnx.Rngs(1), **kw)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def nnx_step(model, state_type):
  """One train step: forward stats in the call, backward ones from grad."""
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, state_type))

  def loss(m):
    return jnp.sum(jnp.sin(m(X)) ** 2)

  grads = nnx.grad(loss, argnums=diff)(model)
  qnnx.update_state(model, grads)
  return grads


def test_delayed_scaling_through_rules_equals_the_explicit_nnx_ops():
  ruled = aqtr.flax.quantize(Mlp(), Rule(CFG))
  explicit = Mlp(lambda: qnnx.DotGeneral(CFG))
  fwd = nnx.jit(lambda m: m(X))
  np.testing.assert_array_equal(fwd(ruled), fwd(explicit))  # makes state
  step = nnx.jit(nnx_step, static_argnums=1)
  for _ in range(2):
    g1 = step(ruled, QuantState)
    g2 = step(explicit, qnnx.CalibState)
    for name in ('up', 'down'):
      np.testing.assert_array_equal(
        getattr(g1, name)['kernel'][...], getattr(g2, name)['kernel'][...]
      )
      got = getattr(ruled, name).aqtr_state.get_value()['dot_general0']
      want = getattr(explicit, name).dot_general.aqtr_state.get_value()
      jax.tree.map(np.testing.assert_array_equal, got, want)
    np.testing.assert_array_equal(fwd(ruled), fwd(explicit))
  hist = ruled.up.aqtr_state.get_value()['dot_general0']['dlhs.lhs']
  assert float(hist['history'].max()) > 0  # the backward stats arrived


def test_nnx_state_under_jit_and_orbax_round_trip(tmp_path):
  import aqtr.flax.checkpoint as ckpt

  q = aqtr.flax.quantize(Mlp(), Rule(CFG))
  nnx.jit(lambda m: m(X))(q)  # the state is created inside jit
  nnx.jit(lambda m: nnx_step(m, QuantState))(q)
  state = nnx.state(q, QuantState)
  ckpt.save(str(tmp_path / 'c'), state)
  back = ckpt.restore(str(tmp_path / 'c'), state)
  jax.tree.map(np.testing.assert_array_equal, back, state)


def test_state_of_another_shape_is_one_line():
  q = aqtr.flax.quantize(Mlp(), Rule(CFG))
  q(X)
  other = aqtr.flax.quantize(Mlp(), Rule(aqtr.presets.fp8_delayed(8)))
  other(X)
  nnx.update(q, nnx.state(other, QuantState))
  with pytest.raises(ValueError) as e:
    q(X)
  msg = str(e.value)
  assert msg.startswith('up/dot_general0 ') and '\n' not in msg
  assert 'state of another model or shape' in msg


def test_lsq_learned_steps_are_params_the_optimizer_trains():
  import optax

  q = aqtr.flax.quantize(Mlp(), Rule(aqtr.presets.int4_lsq()))
  q(X)  # eager first call: makes the learned steps before the optimizer
  steps = q.up.aqtr_learned.get_value()['dot_general0']
  assert set(steps) == {'fwd.lhs', 'fwd.rhs'}
  opt = nnx.Optimizer(q, optax.sgd(0.1), wrt=nnx.Param)
  before = q.up.aqtr_learned.get_value()['dot_general0']['fwd.lhs']['step']

  @nnx.jit
  def train(q, opt):
    opt.update(q, nnx.grad(lambda m: jnp.sum(m(X) ** 2))(q))

  train(q, opt)
  after = q.up.aqtr_learned.get_value()['dot_general0']['fwd.lhs']['step']
  assert not np.array_equal(before, after)


def test_lsq_first_created_under_a_transform_is_one_line():
  q = aqtr.flax.quantize(Mlp(), Rule(aqtr.presets.int4_lsq()))
  with pytest.raises(ValueError, match='optimizer cannot see them'):
    nnx.jit(lambda m: m(X))(q)


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='down')(jax.nn.relu(nn.Dense(16, name='up')(x)))


def test_linen_state_collection_and_learned_params(tmp_path):
  import aqtr.flax.checkpoint as ckpt

  q = aqtr.flax.quantize(LinenMlp(), Rule(CFG))
  v = jax.jit(q.init)(jax.random.key(0), X)
  assert set(v['aqtr_state']['up']) == {'dot_general0'}

  def loss(p, s):
    out, upd = q.apply(
      {'params': p, 'aqtr_state': s}, X, mutable=['aqtr_state']
    )
    return jnp.sum(out**2), upd['aqtr_state']

  (_, upd), (_, gs) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
    v['params'], v['aqtr_state']
  )
  new = aqtr.state.merge_tree(upd, gs)
  ckpt.save(str(tmp_path / 'linen'), {**v, 'aqtr_state': new})
  back = ckpt.restore(str(tmp_path / 'linen'), {**v, 'aqtr_state': new})
  jax.tree.map(np.testing.assert_array_equal, back['aqtr_state'], new)
  h = new['up']['dot_general0']
  assert float(h['fwd.lhs']['history'].max()) > 0
  assert float(h['dlhs.lhs']['history'].max()) > 0
  with pytest.raises(ValueError, match=r"^up/dot_general0 .*mutable=\['aqtr"):
    q.apply(v, X)
  lsq = aqtr.flax.quantize(LinenMlp(), Rule(aqtr.presets.int4_lsq()))
  lv = jax.jit(lsq.init)(jax.random.key(0), X)
  assert 'dot_general0' in lv['params']['up']['aqtr_learned']
  with pytest.raises(ValueError, match='optimizer cannot see it'):
    lsq.apply({'params': q.init(jax.random.key(0), X)['params']}, X)


@pytest.mark.parametrize('preset', ['fp8_delayed', 'int4_lsq'])
def test_convert_freezes_with_the_state_and_serves_as_trained(preset):
  cfg = getattr(aqtr.presets, preset)()
  q = aqtr.flax.quantize(Mlp(), Rule(cfg))
  q(X)
  nnx.jit(lambda m: nnx_step(m, QuantState))(q)
  served = aqtr.flax.convert(q, X)  # checks serve == train under jit
  fwd = nnx.jit(lambda m: m(X))
  np.testing.assert_array_equal(fwd(served), fwd(q))
  assert is_holder(served.up.kernel)


def test_linen_convert_with_state():
  q = aqtr.flax.quantize(LinenMlp(), Rule(CFG))
  v = jax.jit(q.init)(jax.random.key(0), X)
  sm, sv = aqtr.flax.convert(q, X, variables=v)
  want, _ = jax.jit(lambda v: q.apply(v, X, mutable=['aqtr_state']))(v)
  np.testing.assert_array_equal(jax.jit(sm.apply)(sv, X), want)
