"""Contract on the MoE model kind: every registry entry on the experts.

As `test_catalogue_contract` (state, a jitted train step, convert, serve
== train bit for bit), with each entry on both `lax.ragged_dot` expert
matmuls of a stock nnx MoE (top-1 router, which stays float): the
experts keep per-expert state, learned parameters, schedules and keys
like any dot. All slow (each entry compiles a train step, convert and
serve).
"""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import catalogue_cases as cc  # noqa: E402

W, FF, E = 32, 64, 4  # K divisible by the block formats' 32
X = jax.random.normal(jax.random.key(0), (8, W))
FAST = ('calibrations:delayed_scaling',)


class Moe(nnx.Module):
  """Top-1 routing; the experts' two matmuls are `lax.ragged_dot`s."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.router = nnx.Linear(W, E, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal()
    self.wi = nnx.Param(init(rngs.params(), (E, W, FF)))
    self.wo = nnx.Param(init(rngs.params(), (E, FF, W)))

  def __call__(self, x):
    logits = self.router(x)
    e = jnp.argmax(logits, -1)
    order = jnp.argsort(e)
    sizes = jnp.bincount(e, length=E).astype(jnp.int32)
    h = jax.nn.gelu(jax.lax.ragged_dot(x[order], self.wi[...], sizes))
    y = jax.lax.ragged_dot(h, self.wo[...], sizes)
    gate = jax.nn.softmax(logits)[jnp.arange(x.shape[0]), e]
    return jnp.zeros_like(x).at[order].set(y) * gate[:, None]


def moe_contract(entry):
  """The entry on both expert matmuls (the root module's ragged dots)."""
  cfg = cc.config(entry)
  rules = [cc.Rule(cfg, op='ragged_dot'), cc.Rule(None)]
  return cc.nnx_contract(Moe(), [entry], [''], X, rules=rules)


@pytest.mark.slow  # ~10 s quiet (a train step, convert, serve compiled)
def test_delayed_scaling_on_the_experts():
  q = moe_contract(FAST[0])
  held = q.aqtr_state.get_value()
  assert set(held) == {'ragged_dot0', 'ragged_dot1'}
  assert held['ragged_dot1']['fwd.rhs']['history'].shape[1] == E  # per expert


@pytest.mark.slow
@pytest.mark.parametrize('entry', cc.ENTRIES)
def test_catalogue_moe_experts(entry):
  moe_contract(entry)
