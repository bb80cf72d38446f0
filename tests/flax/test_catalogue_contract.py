"""Contract: every registry entry runs through rules on every model kind.

Every registered calibration, numerics, rounding and sparsity
(`catalogue_cases.ENTRIES`) is put on ops of a stock model by rules (one
entry per op path); each run makes the state, takes a jitted train step
(forward and backward stats, learned parameters' gradients), converts
(the calibration state and the weights frozen) and checks serve == train
bit for bit under jit. Model kinds: an nnx stack of `nnx.Linear`, a linen
stack of `nn.Dense`, the stock nnx Llama (scan over layers) and a real
third-party model (`tests/models/zoo.py`). The default suite runs three
entries of three families on the two stacks; the whole matrix is slow.
"""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.flax
import aqtr.flax.nnx as qnnx
from aqtr.flax.rule_state import QuantState
from aqtr.rules import Rule

sys.path.insert(0, os.path.dirname(__file__))
import catalogue_cases as cc  # noqa: E402
import stock_models as sm  # noqa: E402

W = 32  # divisible by the block formats' 32
X = jax.random.normal(jax.random.key(0), (4, W))
FAST = ('calibrations:delayed_scaling', 'rounding:stochastic', 'sparsity:n_m')


class Stack(nnx.Module):
  def __init__(self, n):
    self.layers = nnx.List(
      [nnx.Linear(W, W, rngs=nnx.Rngs(i)) for i in range(n)]
    )

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


class LinenStack(nn.Module):
  n: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.n):
      x = jnp.tanh(nn.Dense(W, name=f'layers_{i}')(x))
    return x


def learns(entries) -> bool:
  return any(e.split(':')[1] in ('lsq', 'pact') for e in entries)


def nnx_contract(model, entries, paths, x):
  """Rules per path, state, a train step, convert, serve == train."""
  pairs = zip(entries, paths[: len(entries)], strict=True)
  rules = [Rule(cc.config(e), path=p) for e, p in pairs]
  q = aqtr.flax.quantize(model, rules, rngs=nnx.Rngs(aqtr=0))
  fwd = nnx.jit(lambda m: m(x))
  # Learned parameters are made by an eager first call (the optimizer
  # must see them); the rest inside jit.
  q(x) if learns(entries) else fwd(q)
  diff = nnx.DiffState(0, nnx.Any(nnx.Param, QuantState))

  @nnx.jit
  def step(m):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=diff)(m)
    qnnx.update_state(m, grads)
    return grads

  grads = step(q)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  served = aqtr.flax.convert(q, x)
  np.testing.assert_array_equal(fwd(served), fwd(q))
  return q


def linen_contract(entries):
  rules = [
    Rule(cc.config(e), path=f'layers_{i}') for i, e in enumerate(entries)
  ]
  q = aqtr.flax.quantize(LinenStack(len(entries)), rules)
  v = jax.jit(q.init)(jax.random.key(0), X)
  rngs = {'aqtr': jax.random.key(1)}

  def loss(p, s):
    out, upd = q.apply(
      {**v, 'params': p, 'aqtr_state': s},
      X,
      mutable=['aqtr_state'],
      rngs=rngs,
    )
    return jnp.sum(out**2), upd['aqtr_state']

  state = v.get('aqtr_state', {})
  grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  (_, upd), (gp, gs) = grad(v['params'], state)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(gp))
  v = {**v, 'aqtr_state': aqtr.state.merge_tree(upd, gs)} if state else v
  sm_, sv = aqtr.flax.convert(q, X, variables=v)
  want = jax.jit(lambda v: q.apply(v, X, mutable=['aqtr_state'], rngs=rngs)[0])(
    v
  )
  np.testing.assert_array_equal(jax.jit(sm_.apply)(sv, X), want)


def test_entries_cover_every_registry():
  for fam, reg in cc.FAMILIES.items():
    assert {e for e in cc.ENTRIES if e.startswith(fam + ':')} == {
      f'{fam}:{n}' for n in reg.names()
    }


def test_fast_entries_nnx_stack():
  nnx_contract(
    Stack(len(FAST)), FAST, [f'layers/{i}' for i in range(len(FAST))], X
  )


def test_fast_entries_linen_stack():
  linen_contract(FAST)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(9), ids=lambda c: c[0])
def test_catalogue_nnx_stack(chunk):
  nnx_contract(
    Stack(len(chunk)), chunk, [f'layers/{i}' for i in range(len(chunk))], X
  )


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(9), ids=lambda c: c[0])
def test_catalogue_linen_stack(chunk):
  linen_contract(chunk)


# The stock Llama's weight ops (each runs in every scanned layer).
LLAMA_OPS = (
  'layers/q',
  'layers/kv',
  'layers/o',
  'layers/gate',
  'layers/up',
  'layers/down',
  'head',
)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(7), ids=lambda c: c[0])
def test_catalogue_stock_llama(chunk):
  ids = jax.random.randint(jax.random.key(0), (2, sm.T), 0, sm.VOCAB)
  nnx_contract(sm.Llama(nnx.Rngs(0)), chunk, LLAMA_OPS, ids)
