"""Stateful and learned calibrations through TRAIN / CONVERT / SERVE."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.calibrations import (
  DelayedScaling,
  EmaStats,
  Lsq,
  MeanAbsMax,
  Pact,
)
from aqtr.freezers import Mode, lifecycle

DN = (((1,), (0,)), ((), ()))

CASES = {
  'delayed_scaling_tensor': (
    DelayedScaling(history_length=3),
    DelayedScaling(history_length=3),
    aqtr.tilings.PerTensor(),
  ),
  'delayed_scaling_channel': (
    DelayedScaling(history_length=3),
    DelayedScaling(history_length=3),
    aqtr.tilings.PerChannel(),
  ),
  'ema_stats': (EmaStats(), EmaStats(), aqtr.tilings.PerChannel()),
  'mean_absmax': (MeanAbsMax(), MeanAbsMax(), aqtr.tilings.PerTensor()),
  'lsq': (Lsq(), Lsq(), aqtr.tilings.PerChannel()),
  'pact_lhs_lsq_rhs': (Pact(), Lsq(), aqtr.tilings.PerTensor()),
}


def _cfg(lhs_cal, rhs_cal, tiling):
  base = aqtr.presets.int8()

  def t(cal, tensor):
    return dataclasses.replace(tensor, calibration=cal, tiling=tiling)

  fwd = dataclasses.replace(
    base.fwd, lhs=t(lhs_cal, base.fwd.lhs), rhs=t(rhs_cal, base.fwd.rhs)
  )
  return aqtr.freezers.configure(
    dataclasses.replace(base, fwd=fwd), rhs='weights'
  )


def _trained_state(cfg, x, w, steps=3):
  """The state after a few steps on scaled inputs (histories not empty)."""
  s = aqtr.state.init(x, w, DN, cfg)

  @jax.jit
  def step(w, s, scale):
    def loss(w, s):
      out, new = aqtr.dot_general(x * scale, w, DN, cfg, state=s)
      return jnp.sum(out**2), new

    (_, new), (_, gs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, s)
    return aqtr.state.merge(new, gs)

  for i in range(steps):
    s = step(w, s, jnp.float32(1.0 + 0.5 * i))
  return s


@pytest.mark.parametrize('name', sorted(CASES))
def test_serve_equals_train_bit_exact_after_convert(name):
  cfg = _cfg(*CASES[name])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  s = _trained_state(cfg, x, w)
  train = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg, state=s), Mode.TRAIN)
  conv = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg, state=s), Mode.CONVERT)
  serve = lifecycle.run(
    lifecycle.DotCall(x, jnp.zeros_like(w), DN, cfg, state=s),
    Mode.SERVE,
    frozen=conv.frozen,
  )
  np.testing.assert_array_equal(train.out, conv.out)
  np.testing.assert_array_equal(train.out, serve.out)
  assert train.state is not None and set(train.state) == set(s)
  assert conv.frozen['rhs']['qvalue'].dtype == jnp.int8


def test_frozen_scale_is_the_state_bound():
  """CONVERT of delayed scaling freezes max(history), not the current amax."""
  cfg = _cfg(
    DelayedScaling(history_length=2),
    DelayedScaling(history_length=2),
    aqtr.tilings.PerTensor(),
  )
  x, w = jnp.ones((2, 16)), jnp.full((16, 4), 0.5)
  s = aqtr.state.init(x, w, DN, cfg)
  hist = s['fwd.rhs']['stats']['history']
  s['fwd.rhs']['stats']['history'] = hist.at[1].set(2.0)
  conv = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg, state=s), Mode.CONVERT)
  scale = conv.frozen['rhs']['scale']
  np.testing.assert_allclose(scale, 2.0 / 127, rtol=1e-6)


def test_calibrate_returns_the_new_state():
  cfg = _cfg(MeanAbsMax(), MeanAbsMax(), aqtr.tilings.PerTensor())
  x, w = jnp.ones((2, 16)), jnp.ones((16, 4))
  s = aqtr.state.init(x, w, DN, cfg)
  r = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg, state=s), Mode.CALIBRATE)
  assert r.state is not None
  changed = jax.tree.map(lambda a, b: bool((a != b).any()), s, r.state)
  assert any(jax.tree.leaves(changed))


def test_missing_state_names_the_operand_path():
  cfg = _cfg(Lsq(), Lsq(), aqtr.tilings.PerChannel())
  x, w = jnp.ones((2, 16)), jnp.ones((16, 4))
  with pytest.raises(ValueError, match=r'fwd\.lhs: calibration Lsq'):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.TRAIN)


def test_learned_state_on_a_stored_operand_is_a_clear_error():
  cfg = aqtr.presets.int8()
  rhs = dataclasses.replace(cfg.fwd.rhs, calibration=Lsq())
  cfg = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))
  x, w = jnp.ones((2, 16)), jnp.ones((16, 4))
  s = aqtr.state.init(x, w, DN, cfg)
  q = aqtr.quantize_operand(w, DN, cfg, state=s['fwd.rhs'])
  with pytest.raises(ValueError, match=r'fwd\.rhs: the operand is a stored'):
    aqtr.dot_general(x, q, DN, cfg, state=s)
  out = aqtr.dot_general(x, q, DN, cfg, state={})[0]
  ref = aqtr.dot_general(x, w, DN, cfg, state=s)[0]
  np.testing.assert_array_equal(out, ref)
