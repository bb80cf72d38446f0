"""Stateful calibrations and static ranges on ragged_dot experts, by rules.

The experts of a stock MoE (`lax.ragged_dot`) keep per-expert state in the
module that runs them, as dots do: the same values as `aqtr.ragged_dot`
called explicitly with that state, the backward passes' stats arriving,
convert freezing with it (serve == train); CALIBRATE's static activation
ranges reach the experts too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import stock_models as sm
from flax import nnx

import aqtr
import aqtr.flax
import aqtr.flax.nnx as qnnx
from aqtr import calibrations, tilings
from aqtr.flax.frozen import is_holder
from aqtr.flax.rule_state import QuantState
from aqtr.rules import Rule

X = jax.random.normal(jax.random.key(0), (8, sm.D))
G = 4


def per_expert_delayed():
  """Delayed scaling: activations per tensor, weights per expert+channel."""
  cal = calibrations.DelayedScaling(history_length=4)
  t = aqtr.TensorConfig(calibration=cal)
  w = aqtr.TensorConfig(calibration=cal, tiling=tilings.PerChannel())
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=t, rhs=w),
    dlhs=aqtr.DotGeneralRaw(lhs=t, rhs=w, use_fwd_quant=True),
  )


def explicit(m, x, cfg, states):
  """`sm.Moe.__call__` with `aqtr.ragged_dot` and explicit state."""
  logits = m.router(x)
  e = jnp.argmax(logits, -1)
  order = jnp.argsort(e)
  sizes = jnp.bincount(e, length=G).astype(jnp.int32)
  h, s0 = aqtr.ragged_dot(x[order], m.wi[...], sizes, cfg, state=states[0])
  y, s1 = aqtr.ragged_dot(
    jax.nn.gelu(h), m.wo[...], sizes, cfg, state=states[1]
  )
  gate = jax.nn.softmax(logits)[jnp.arange(x.shape[0]), e]
  return jnp.zeros_like(x).at[order].set(y) * gate[:, None], (s0, s1)


def engine_states(q):
  held = q.aqtr_state.get_value()
  return tuple(
    {p: {'stats': v, 'learned': {}} for p, v in held[f'ragged_dot{i}'].items()}
    for i in (0, 1)
  )


def test_per_expert_delayed_state_equals_explicit_ragged_dot():
  cfg = per_expert_delayed()
  q = aqtr.flax.quantize(
    sm.Moe(G, nnx.Rngs(0)), [Rule(cfg, op='ragged_dot'), Rule(None)]
  )
  fwd = nnx.jit(lambda m: m(X))
  fwd(q)  # creates the state (and takes the first forward stats)
  before = engine_states(q)
  # One history per expert and output channel.
  assert before[0]['fwd.rhs']['stats']['history'].shape[1] == G
  out = fwd(q)
  want, new = jax.jit(explicit, static_argnums=2)(q, X, cfg, before)
  np.testing.assert_array_equal(out, want)
  got = engine_states(q)
  for i in (0, 1):
    np.testing.assert_array_equal(
      got[i]['fwd.rhs']['stats']['history'],
      new[i]['fwd.rhs']['stats']['history'],
    )
  # The backward passes' stats come back through update_state.
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantState))
  step = nnx.grad(lambda m: jnp.sum(m(X) ** 2), argnums=diff)
  qnnx.update_state(q, nnx.jit(step)(q))
  hist = q.aqtr_state.get_value()['ragged_dot1']['dlhs.lhs']['history']
  assert float(hist.max()) > 0


@pytest.mark.slow
def test_per_expert_delayed_state_converts():
  q = aqtr.flax.quantize(
    sm.Moe(G, nnx.Rngs(0)), [Rule(per_expert_delayed(), op='ragged_dot')]
  )
  nnx.jit(lambda m: m(X))(q)
  served = aqtr.flax.convert(q, X)  # checks serve == train under jit
  assert is_holder(served.wi)


@pytest.mark.slow
def test_static_ranges_reach_the_experts():
  cfg = aqtr.presets.maxtext_deepseek_fp8()  # lhs: CALIBRATE's static range
  q = aqtr.flax.quantize(
    sm.Moe(G, nnx.Rngs(0)), [Rule(cfg, op='ragged_dot'), Rule(None)]
  )
  aqtr.flax.calibrate(q, [X, 3.0 * X])
  stats = q.aqtr_stats.get_value()
  assert set(stats) == {'ragged_dot0', 'ragged_dot1'}
  assert int(stats['ragged_dot0']['lhs']['count']) == 2
  # The experts' input range: the mean absmax over the batches.
  np.testing.assert_allclose(
    stats['ragged_dot0']['lhs']['mean'], 2.0 * jnp.abs(X).max(), rtol=1e-6
  )
  fwd = nnx.jit(lambda m, x: m(x))
  a = fwd(q, X)  # TRAIN after CALIBRATE: the static ranges
  served = aqtr.flax.convert(q, X)
  np.testing.assert_array_equal(fwd(served, X), a)
