"""Stock linen ops whose shapes broadcast, quantized by rules.

Multi-query attention (one key / value head broadcast over the query
heads in the einsum, as Gemma 3 and Griffin write it) and a weight with a
batch axis (one matrix per head, Griffin's block-diagonal gates).
"""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import aqtr
import aqtr.flax as af
from aqtr.core.lowering import sub_jaxprs
from aqtr.flax import Rule

B, T, H, D = 2, 8, 4, 16


class Mqa(nn.Module):
  """Attention with one KV head, broadcast in the einsums."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((H, D), name='q')(x)
    k = nn.DenseGeneral((1, D), name='k')(x)
    v = nn.DenseGeneral((1, D), name='v')(x)
    logits = jnp.einsum('bthd,bshd->bhts', q, k)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum('bhts,bshd->bthd', probs, v).reshape(x.shape)


class BlockDiagonal(nn.Module):
  """One (D, D) matrix per head: '... h i, h i j -> ... h j'."""

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.normal(1.0), (H, D, D))
    return jnp.einsum('... h i, h i j -> ... h j', x, w)


def _int8_dots(jaxpr) -> int:
  n = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      n[str(eqn.invars[0].aval.dtype)] += 1
    for sub in sub_jaxprs(eqn):
      n['int8'] += _int8_dots(sub)
  return n['int8']


def test_multi_query_einsums_are_quantized():
  x = jax.random.normal(jax.random.key(0), (B, T, H * D))
  model = Mqa()
  v = model.init(jax.random.key(1), x)
  q = af.quantize(model, [Rule('int8')])
  rep = af.report(q, x, variables=v)
  assert rep.float_paths() == [] and len(rep.ops) == 5, rep
  assert _int8_dots(jax.make_jaxpr(lambda v: q.apply(v, x))(v).jaxpr) == 5
  y, y0 = q.apply(v, x), model.apply(v, x)
  assert 0 < float(jnp.abs(y - y0).max()) < 0.05 * float(jnp.abs(y0).max())
  sm, sv = af.convert(q, x, variables=v)
  np.testing.assert_array_equal(sm.apply(sv, x), y)


def test_a_weight_with_a_batch_axis_has_scales_per_batch_index():
  x = jax.random.normal(jax.random.key(0), (B, T, H, D))
  model = BlockDiagonal()
  v = model.init(jax.random.key(1), x)
  w = v['params']['w'] * jnp.array([1e-3, 1.0, 10.0, 1e3])[:, None, None]
  v = {'params': {'w': w}}
  q = af.quantize(model, [Rule('int8_weight_only', weight=True)])
  rep = af.report(q, x, variables=v)
  assert rep.quantized_paths() == ['einsum0'] and rep.ops[0].weight == 'rhs'
  y, y0 = q.apply(v, x), model.apply(v, x)
  # Each head's matrix has its own scales: the small ones are not flushed.
  err = jnp.abs(y - y0).max(axis=(0, 1, 3)) / jnp.abs(y0).max(axis=(0, 1, 3))
  assert 0 < float(err.max()) < 0.02, err
  want = aqtr.einsum(
    '...hi,hij->...hj', x, w, config=aqtr.presets.int8_weight_only()
  )
  np.testing.assert_array_equal(y, want)
  sm, sv = af.convert(q, x, variables=v)
  np.testing.assert_array_equal(sm.apply(sv, x), y)


class MqaMatmul(nn.Module):
  """Multi-query attention written with `@`: size-1 head axis broadcast."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((H, D), name='q')(x).transpose(0, 2, 1, 3)
    k = nn.DenseGeneral((1, D), name='k')(x).transpose(0, 2, 3, 1)
    return (q @ k).reshape(x.shape[0], -1)


def test_matmul_with_a_size_one_batch_axis_is_quantized():
  x = jax.random.normal(jax.random.key(0), (B, T, H * D))
  model = MqaMatmul()
  v = model.init(jax.random.key(1), x)
  q = af.quantize(model, [Rule('int8')])
  rep = af.report(q, x, variables=v)
  assert rep.float_paths() == [] and len(rep.ops) == 3, rep
  assert _int8_dots(jax.make_jaxpr(lambda v: q.apply(v, x))(v).jaxpr) == 3
  y, y0 = q.apply(v, x), model.apply(v, x)
  assert 0 < float(jnp.abs(y - y0).max()) < 0.05 * float(jnp.abs(y0).max())
  sm, sv = af.convert(q, x, variables=v)
  np.testing.assert_array_equal(sm.apply(sv, x), y)
