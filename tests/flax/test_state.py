"""Stateful and learned calibrations carried by linen and nnx models."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_cases import INIT, bitwise

import aqtr
import aqtr.flax.checkpoint as ckpt
import aqtr.flax.linen as ql
import aqtr.flax.nnx as qn
from aqtr.calibrations import Lsq, Pact
from aqtr.freezers import Mode


def _lsq_config():
  """int4 with LSQ steps on the weights and PACT on the activations."""
  base = aqtr.presets.int8()
  int4 = aqtr.numerics.IntSymmetric(bits=4, preserve_max_val=True)
  lhs = dataclasses.replace(
    base.fwd.lhs,
    numerics=int4,
    calibration=Pact(init_clip=3.0),
    tiling=aqtr.tilings.PerTensor(),
  )
  rhs = dataclasses.replace(base.fwd.rhs, numerics=int4, calibration=Lsq())
  return dataclasses.replace(
    base, fwd=dataclasses.replace(base.fwd, lhs=lhs, rhs=rhs)
  )


class Mlp(nn.Module):
  config: aqtr.DotGeneralConfig
  mode: Mode = Mode.TRAIN

  @nn.compact
  def __call__(self, x):
    dg = functools.partial(ql.DotGeneral, config=self.config, mode=self.mode)
    x = nn.relu(nn.Dense(16, dot_general_cls=dg, **INIT)(x))
    return nn.Dense(4, dot_general_cls=dg, **INIT)(x)


def _data(n=32, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
  return x, jnp.tanh(x @ w)


def _linen_step(model, tx):
  @jax.jit
  def step(v, opt, x, y):
    def loss(p, st):
      out, upd = model.apply({'params': p, ql.STATE: st}, x, mutable=[ql.STATE])
      return jnp.mean((out - y) ** 2), upd[ql.STATE]

    (loss_v, upd), (gp, gst) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      v['params'], v[ql.STATE]
    )
    updates, opt = tx.update(gp, opt, v['params'])
    params = optax.apply_updates(v['params'], updates)
    return (
      {'params': params, ql.STATE: aqtr.state.merge_tree(upd, gst)},
      opt,
      loss_v,
    )

  return step


def test_linen_fp8_delayed_histories_fill_from_both_passes():
  cfg = aqtr.presets.fp8_delayed(history_length=3)
  x, y = _data()
  model = Mlp(cfg)
  v = model.init(jax.random.key(0), x)
  assert set(v) == {'params', ql.STATE}
  tx = optax.sgd(0.05)
  step, opt = _linen_step(model, tx), tx.init(v['params'])
  for _ in range(2):
    v, opt, _ = step(v, opt, x, y)
  stats = v[ql.STATE]['Dense_0']['DotGeneral_0']['stats']
  for path in ('fwd.lhs', 'fwd.rhs', 'dlhs.lhs', 'drhs.lhs'):
    h = np.asarray(stats[path]['history']).ravel()
    assert h[0] > 0 and h[1] > 0 and h[2] == 0, path  # 2 steps recorded
  np.testing.assert_allclose(
    stats['fwd.lhs']['history'].ravel()[0], jnp.abs(x).max(), rtol=1e-6
  )


def test_linen_lsq_pact_learn_and_serve_bit_exact():
  cfg = aqtr.freezers.configure(_lsq_config(), rhs='weights')
  x, y = _data()
  v = Mlp(cfg).init(jax.random.key(0), x)
  learned = v['params']['Dense_0']['DotGeneral_0'][ql.LEARNED]
  assert set(learned) == {'fwd.lhs', 'fwd.rhs'}
  assert ql.STATE not in v  # LSQ and PACT keep no stats.
  tx = optax.adam(1e-2)
  opt = tx.init(v['params'])

  @jax.jit
  def step(p, opt):
    def loss(p):
      out = Mlp(cfg).apply({'params': p}, x)
      return jnp.mean((out - y) ** 2)

    lv, g = jax.value_and_grad(loss)(p)
    u, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, u), opt, lv

  p, losses = v['params'], []
  for _ in range(30):
    p, opt, lv = step(p, opt)
    losses.append(float(lv))
  assert losses[-1] < 0.7 * losses[0]
  moved = jax.tree.map(
    lambda a, b: float(jnp.abs(a - b).max()),
    p['Dense_0']['DotGeneral_0'][ql.LEARNED],
    learned,
  )
  assert min(jax.tree.leaves(moved)) > 0  # steps and clips were trained
  trained = {'params': p}
  serving = ql.convert(Mlp(cfg, Mode.CONVERT), trained, x)
  bitwise(Mlp(cfg, Mode.SERVE).apply(serving, x), Mlp(cfg).apply(trained, x))


def test_linen_state_errors_are_clear():
  cfg = aqtr.presets.fp8_delayed()
  x, _ = _data(4)
  model = Mlp(cfg)
  v = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="apply with mutable=\\['aqtr_state'\\]"):
    model.apply(v, x)
  with pytest.raises(ValueError, match='collection .aqtr_state.: create it'):
    model.apply({'params': v['params']}, x)


def test_linen_state_scan_equals_loop_and_orbax_round_trip(tmp_path):
  cfg = aqtr.freezers.configure(aqtr.presets.fp8_delayed(4), rhs='weights')
  x, y = _data()
  model = Mlp(cfg)
  v = model.init(jax.random.key(0), x)
  tx = optax.sgd(0.05)
  step = _linen_step(model, tx)
  opt = tx.init(v['params'])
  looped = (v, opt)
  for _ in range(3):
    looped = step(*looped, x, y)[:2]

  def body(carry, _):
    v, opt, _ = step(*carry, x, y)
    return (v, opt), None

  scanned = jax.lax.scan(body, (v, opt), None, length=3)[0]
  jax.tree.map(bitwise, scanned[0], looped[0])
  trained = looped[0]
  ckpt.save(tmp_path / 'trained', trained)
  restored = ckpt.restore(tmp_path / 'trained', jax.eval_shape(lambda: trained))
  jax.tree.map(bitwise, restored, trained)
  serving = ql.convert(Mlp(cfg, Mode.CONVERT), restored, x)
  out_train = model.apply(restored, x, mutable=[ql.STATE])[0]
  bitwise(Mlp(cfg, Mode.SERVE).apply(serving, x), out_train)


class NnxMlp(nnx.Module):
  def __init__(self, cfg, rngs):
    self.l1 = nnx.Linear(8, 16, dot_general=qn.DotGeneral(cfg), rngs=rngs)
    self.l2 = nnx.Linear(16, 4, dot_general=qn.DotGeneral(cfg), rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def test_nnx_delayed_scaling_trains_converts_and_serves_bit_exact():
  cfg = aqtr.freezers.configure(aqtr.presets.fp8_delayed(3), rhs='weights')
  x, y = _data()
  m = NnxMlp(cfg, nnx.Rngs(0))
  m(x)  # Creates the ops' CalibState.
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, qn.CalibState))
  opt = nnx.Optimizer(m, optax.sgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    def loss(m):
      return jnp.mean((m(x) - y) ** 2)

    grads = nnx.grad(loss, argnums=diff)(m)
    qn.update_state(m, grads)
    opt.update(m, nnx.filter_state(grads, nnx.Param))

  for _ in range(2):
    step(m, opt)
  h = m.l1.dot_general.aqtr_state.get_value()
  # The first call and two steps: 3 forward entries, 2 backward ones.
  for path, n in (('fwd.lhs', 3), ('dlhs.lhs', 2), ('drhs.lhs', 2)):
    hist = np.asarray(h[path]['history']).ravel()
    assert (hist[:n] > 0).all() and (hist[n:] == 0).all(), path
  saved = jax.tree.map(jnp.copy, nnx.state(m, qn.CalibState))
  want = m(x)  # TRAIN at the saved state (the call advances it).
  nnx.update(m, saved)
  qn.convert(m, x)  # CONVERT and SERVE do not advance the state.
  bitwise(m(x), want)
  bitwise(m(x), want)


def test_nnx_update_state_needs_a_first_call():
  m = nnx.Linear(
    8,
    2,
    rngs=nnx.Rngs(0),
    dot_general=qn.DotGeneral(aqtr.presets.fp8_delayed()),
  )
  x = jnp.ones((2, 8))
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, qn.CalibState))
  grads = nnx.grad(lambda m: m(x).sum(), argnums=diff)(m)
  with pytest.raises(ValueError, match='call the model once'):
    qn.update_state(m, grads)
