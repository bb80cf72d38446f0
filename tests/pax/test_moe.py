"""MoeFeedForward: routing, the float layer against a per-token reference,
injection of quantized ragged dots, and a small MoE LM that trains."""

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import aqtr
import aqtr.pax
from aqtr.core.lowering import sub_jaxprs
from aqtr.pax import moe, next_token_loss, templates

from .helpers import SEQ, VOCAB, tokens

E, D, H = 4, 16, 32


def moe_lm(**kw) -> fdl.Config:
  tpl = templates.block(D, 2, H)
  tpl.ffn = templates.moe_feed_forward(D, H, num_experts=E, **kw)
  return templates.transformer_lm(
    VOCAB, D, 1, 2, H, max_len=SEQ, block_template=tpl
  )


def test_route_sorts_by_expert_and_counts():
  logits = jax.random.normal(jax.random.key(0), (7, E))
  token, weight, gs = moe.route(logits, 2)
  assert int(gs.sum()) == 14
  top = np.argsort(-np.asarray(logits), axis=1)[:, :2]
  pairs = sorted((int(e), t) for t in range(7) for e in top[t])
  assert [t for _, t in pairs] == np.asarray(token).tolist()
  per_token = np.zeros(7)
  np.add.at(per_token, np.asarray(token), np.asarray(weight))
  np.testing.assert_allclose(per_token, 1.0, rtol=1e-6)


@pytest.mark.parametrize('gated', [False, True])
def test_float_layer_matches_per_token_reference(gated):
  layer = fdl.build(
    templates.moe_feed_forward(D, H, num_experts=E, gated=gated)
  )
  x = jax.random.normal(jax.random.key(1), (1, 3, D))
  params = layer.init(jax.random.key(2), x)
  out = layer.apply(params, x)
  p = params['params']
  flat = x.reshape(-1, D)
  logits = flat @ p['router']['kernel']
  probs = jax.nn.softmax(logits, axis=-1)
  want = []
  for t in range(flat.shape[0]):
    top = np.argsort(-np.asarray(probs[t]))[:2]
    w = probs[t][top] / probs[t][top].sum()
    y = 0
    for j, e in enumerate(top):
      h = flat[t] @ p['wi_kernel'][e]
      h = (
        jax.nn.gelu(flat[t] @ p['wi_gate_kernel'][e]) * h
        if gated
        else jax.nn.gelu(h)
      )
      y = y + w[j] * (h @ p['wo_kernel'][e])
    want.append(y)
  np.testing.assert_allclose(
    out.reshape(-1, D), jnp.stack(want), rtol=1e-4, atol=1e-5
  )


def test_top_k_out_of_range():
  layer = fdl.build(templates.moe_feed_forward(D, H, num_experts=E, top_k=5))
  with pytest.raises(ValueError, match='top_k'):
    layer.init(jax.random.key(0), jnp.ones((2, D)))


def ragged_dtypes(fn, *args):
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'ragged_dot_general':
        found.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
      for sub in sub_jaxprs(eqn):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_inject_quantizes_experts_and_lm_trains():
  cfg, report = aqtr.pax.inject(
    moe_lm(gated=True),
    [
      aqtr.pax.Rule('int8', layer=aqtr.pax.Linear),
      aqtr.pax.Rule('int8', layer=aqtr.pax.MoeFeedForward),
    ],
  )
  quantized = report.quantized_paths()
  for name in ('wi', 'wi_gate', 'wo', 'router.einsum'):
    assert f'layers[0].ffn.{name}' in quantized
  lm = fdl.build(cfg)
  ids = tokens(batch=4)
  params = lm.init(jax.random.key(0), ids)

  def loss(p):
    return next_token_loss(lm.apply(p, ids), ids)

  # 3 ragged dots forward + 2 per projection backward, all int8.
  dts = ragged_dtypes(jax.grad(loss), params)
  assert dts == [('int8', 'int8')] * 9

  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(p, s):
    value, g = jax.value_and_grad(loss)(p)
    updates, s = opt.update(g, s)
    return optax.apply_updates(p, updates), s, value

  losses = []
  for _ in range(30):
    params, state, value = step(params, state)
    losses.append(float(value))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.8 * losses[0], losses
