"""Weights are recognised the same way under every transform.

What the report says runs is what runs: for each model the int8 dots of
the forward jaxpr and of the gradient jaxpr are counted and compared with
the report, eager, under `jit`, `grad`, `vjp`, `vmap`, closed over.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr.flax as af
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.flax import Rule, provenance

V, D = 32, 16
IDS = jax.random.randint(jax.random.key(0), (2, 8), 0, V)
X = jax.random.normal(jax.random.key(1), (2, 8, D))


def _int8_dots(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    if is_dot(eqn):
      n += str(eqn.invars[0].aval.dtype) == 'int8'
    for sub in sub_jaxprs(eqn):
      n += _int8_dots(sub)
  return n


class _Attend(nnx.Module):
  """Tied logits through nnx.Embed.attend (jnp.dot(x, table.T))."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.w = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(self.w(self.embed(ids)))


class _MatmulT(nnx.Module):
  """Tied logits as `x @ table.T` and `jnp.dot(x, table.T)`."""

  def __init__(self, rngs, dot=False):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (V, D)))
    self.dot = dot

  def __call__(self, ids):
    x = self.table[...][ids]
    if self.dot:
      return jnp.dot(x, self.table[...].T)
    return x @ self.table[...].T


MODELS = {
  'attend': lambda: _Attend(nnx.Rngs(0)),
  'matmul_t': lambda: _MatmulT(nnx.Rngs(0)),
  'dot_t': lambda: _MatmulT(nnx.Rngs(0), dot=True),
}


def _loss(m, ids):
  return jnp.mean(m(ids) ** 2)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_nnx_report_is_what_runs_under_every_transform(name):
  float_model = MODELS[name]()
  q = af.quantize(float_model, [Rule('int8')])
  rep = af.report(q, IDS)
  n = sum(e.config is not None for e in rep.ops)
  assert n == len(rep.ops) and all(e.weight == 'rhs' for e in rep.ops)
  graphdef, state = nnx.split(q)

  def fwd(s):
    return nnx.merge(graphdef, s)(IDS)

  def grad(s):
    return jax.grad(lambda s: _loss(nnx.merge(graphdef, s), IDS))(s)

  def vjp(s):
    out, back = jax.vjp(lambda s: nnx.merge(graphdef, s)(IDS), s)
    return back(jnp.ones_like(out))

  assert _int8_dots(jax.make_jaxpr(fwd)(state).jaxpr) == n
  assert _int8_dots(jax.make_jaxpr(grad)(state).jaxpr) == 3 * n
  assert _int8_dots(jax.make_jaxpr(vjp)(state).jaxpr) == 3 * n
  # Closed over (parameters are constants of the jitted function).
  assert _int8_dots(jax.make_jaxpr(lambda i: q(i))(IDS).jaxpr) == n
  # Eager, jit and the gradients' losses agree, and are not the float
  # model's (the whole model silently running float is what this guards).
  eager = nnx.value_and_grad(_loss)(q, IDS)[0]
  jitted = nnx.jit(nnx.value_and_grad(_loss))(q, IDS)[0]
  np.testing.assert_allclose(eager, jitted, rtol=1e-6)
  assert abs(float(eager) - float(_loss(float_model, IDS))) > 1e-6
  np.testing.assert_allclose(q(IDS), nnx.jit(lambda m: m(IDS))(q), atol=1e-5)


def test_nnx_vmap_over_examples_keeps_the_weight():
  q = af.quantize(_MatmulT(nnx.Rngs(0)), [Rule('int8')])
  f = jax.vmap(lambda i: q(i[None])[0])
  assert _int8_dots(jax.make_jaxpr(f)(IDS).jaxpr) == 1


class _Head(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.features, use_bias=False, name='proj')(x)


class _HfLike(nn.Module):
  """A Hugging Face Flax LM's tied head: a module bound by a nested
  `apply` with the transposed embedding as its kernel."""

  def setup(self):
    self.embed = nn.Embed(V, D)
    self.block = nn.Dense(D)
    self.lm_head = nn.Dense(V, use_bias=False)

  def __call__(self, ids):
    h = self.block(self.embed(ids))
    table = self.embed.variables['params']['embedding']
    return self.lm_head.apply({'params': {'kernel': table.T}}, h)


def test_linen_nested_apply_head_is_named_converted_and_served():
  m = _HfLike()
  v = m.init(jax.random.key(0), IDS)
  q = af.quantize(m, [Rule('int8')])
  rep = af.report(q, IDS, variables=v)
  assert [e.path for e in rep.ops] == [
    'block/dot_general0',
    'lm_head/dot_general0',
  ]
  assert all(e.config is not None and e.weight == 'rhs' for e in rep.ops)
  # path= rules can target the head.
  only = af.quantize(m, [Rule('int8', path='lm_head')])
  assert [
    e.config is not None for e in af.report(only, IDS, variables=v).ops
  ] == [
    False,
    True,
  ]
  served, sv = af.convert(q, IDS, variables=v)  # checks serve == train
  assert 'embedding' in sv['params']['embed']  # the lookup still reads it
  fwd = jax.make_jaxpr(lambda v: served.apply(v, IDS))(sv).jaxpr
  assert _int8_dots(fwd) == 2

  def grad(v):
    return jax.grad(lambda v: jnp.mean(q.apply(v, IDS) ** 2))(v)

  assert _int8_dots(jax.make_jaxpr(grad)(v).jaxpr) == 6


class _Shared(nn.Module):
  """One submodule called by two layers."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(D, name='shared')
    return dense(nn.relu(dense(x)))


def test_linen_shared_module_called_twice_has_two_ops():
  m = _Shared()
  v = m.init(jax.random.key(0), X)
  q = af.quantize(m, [Rule('int8')])
  rep = af.report(q, X, variables=v)
  assert [e.path for e in rep.ops] == [
    'shared/dot_general0',
    'shared/dot_general1',
  ]
  served, sv = af.convert(q, X, variables=v)
  np.testing.assert_array_equal(
    jax.jit(served.apply)(sv, X), jax.jit(q.apply)(v, X)
  )


class _Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    block = nn.remat(nn.Dense)
    return block(D)(nn.relu(block(D)(x)))


class _WeightNorm(nn.Module):
  """A weight computed from two parameters (v / |v| * g)."""

  @nn.compact
  def __call__(self, x):
    v = self.param('v', nn.initializers.lecun_normal(), (D, D))
    g = self.param('g', nn.initializers.ones, (D,))
    w = v / jnp.linalg.norm(v, axis=0, keepdims=True) * g[None, :]
    return x @ w


@pytest.mark.parametrize('model', [_Remat(), _WeightNorm()], ids=type)
def test_linen_remat_and_derived_weights(model):
  v = model.init(jax.random.key(0), X)
  q = af.quantize(model, [Rule('int8')])
  rep = af.report(q, X, variables=v)
  assert rep.ops and all(e.weight == 'rhs' for e in rep.ops)

  def grad(v):
    return jax.grad(lambda v: jnp.mean(q.apply(v, X) ** 2))(v)

  assert _int8_dots(jax.make_jaxpr(grad)(v).jaxpr) == 3 * len(rep.ops)
  served, sv = af.convert(q, X, variables=v)
  np.testing.assert_array_equal(
    jax.jit(served.apply)(sv, X), jax.jit(q.apply)(v, X)
  )


def test_walk_labels_data_params_and_elsewhere():
  def f(p, x):
    w = provenance.mark(p['w'].T.astype(jnp.float32), op=0, side=1)
    y = provenance.mark(x, op=0, side=0) @ w
    return y + p['b'][x.astype(jnp.int32)[:, 0]][:, None]

  closed = jax.make_jaxpr(f)(
    {'b': jnp.ones((4,)), 'w': jnp.ones((3, 2))}, jnp.ones((4, 2))
  )
  got = provenance.walk(closed, n_params=2)
  assert got.operands[(0, 0)] is provenance.DATA
  assert got.operands[(0, 1)] == provenance.Param(frozenset({1}), False)
  assert got.elsewhere == {0}  # 'b' is gathered by data


def test_counts_helper_sees_nested_jaxprs():
  inner = jax.jit(
    lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())))
  )
  j = jax.make_jaxpr(inner)(
    jnp.ones((2, 3), jnp.int8), jnp.ones((3, 4), jnp.int8)
  )
  assert _int8_dots(j.jaxpr) == 1


class _Conv1D(nn.Module):
  """GPT-2's Conv1D: the kernel is read transposed."""

  @nn.compact
  def __call__(self, x):
    k = self.param('kernel', nn.initializers.normal(), (2 * D, D))
    return x @ k.transpose()


def test_a_parameter_read_only_transposed_leaves_the_serving_tree():
  m = _Conv1D()
  v = m.init(jax.random.key(0), X)
  q = af.quantize(m, [Rule('int8')])
  served, sv = af.convert(q, X, variables=v)
  sizes = af.sizes(served, sv)
  assert sizes.float_kernel_bytes == 2 * D * D * 4  # the kernel is gone
  assert sizes.serving_bytes < sizes.float_kernel_bytes / 3
  np.testing.assert_array_equal(
    jax.jit(served.apply)(sv, X), jax.jit(q.apply)(v, X)
  )
