"""Stochastic rounding through rules: keys per op and per step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.flax
from aqtr import fiddlers
from aqtr.rules import Rule


def fwd_sr():
  """int8 whose forward activations round stochastically."""
  c = aqtr.fiddle.config('int8')
  fiddlers.use_rounding(c, r'fwd\.lhs', 'stochastic')
  return aqtr.fiddle.build(c)


class Twin(nnx.Module):
  """Two layers with the same kernel: only their keys tell them apart."""

  def __init__(self):
    self.a = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(0))
    self.b = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.a(x), self.b(x)


X = jax.random.normal(jax.random.key(5), (4, 8))


def test_nnx_keys_per_op_per_step_and_repeatable_for_a_seed():
  def make():
    return aqtr.flax.quantize(Twin(), Rule(fwd_sr()), rngs=nnx.Rngs(aqtr=0))

  q, r = make(), make()
  a1, b1 = q(X)
  assert not np.array_equal(a1, b1)  # different ops, different keys
  a2, _ = q(X)
  assert not np.array_equal(a1, a2)  # the stream advanced: a new step
  np.testing.assert_array_equal(r(X)[0], a1)  # same seed, same values
  # An explicit key: repeatable, and it wins over the stream.
  k = jax.random.key(7)
  np.testing.assert_array_equal(q(X, aqtr_key=k)[0], r(X, aqtr_key=k)[0])
  # Under nnx.jit the stream advances too.
  step = nnx.jit(lambda m: m(X)[0])
  assert not np.array_equal(step(q), step(q))


def test_nnx_missing_stream_is_one_line_naming_op_and_fix():
  q = aqtr.flax.quantize(Twin(), Rule(fwd_sr()))
  with pytest.raises(ValueError) as e:
    q(X)
  msg = str(e.value)
  assert '\n' not in msg and msg.startswith('a/dot_general0 ')
  assert 'rngs=nnx.Rngs(aqtr=seed)' in msg and 'aqtr_key=' in msg
  # Round-to-nearest models need no stream.
  aqtr.flax.quantize(Twin(), Rule('int8'))(X)


def test_nnx_bad_rngs_argument():
  with pytest.raises(ValueError, match="no stream 'aqtr'"):
    aqtr.flax.quantize(Twin(), Rule('int8'), rngs=nnx.Rngs(0))


def test_backward_stochastic_rounding_differs_per_step():
  cfg = aqtr.presets.fully_quantized(8, 8, True)
  q = aqtr.flax.quantize(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)), Rule(cfg), rngs=nnx.Rngs(aqtr=3)
  )
  x = jax.random.normal(jax.random.key(5), (16, 4))

  @nnx.jit
  def grad(m):
    return nnx.grad(lambda m: (jnp.sin(m(x)) ** 2).sum())(m)['kernel'][...]

  assert not np.array_equal(grad(q), grad(q))


class LinenTwin(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='a')(x), nn.Dense(4, name='b')(x)


def test_linen_keys_from_the_apply_stream_or_argument():
  q = aqtr.flax.quantize(LinenTwin(), Rule(fwd_sr()))
  v = q.init(jax.random.key(0), X)  # init needs no 'aqtr' stream
  v = {'params': {'a': v['params']['a'], 'b': v['params']['a']}}
  a1, b1 = q.apply(v, X, rngs={'aqtr': jax.random.key(1)})
  assert not np.array_equal(a1, b1)
  a2, _ = q.apply(v, X, rngs={'aqtr': jax.random.key(2)})
  assert not np.array_equal(a1, a2)
  again, _ = q.apply(v, X, rngs={'aqtr': jax.random.key(1)})
  np.testing.assert_array_equal(again, a1)
  k = jax.random.key(9)
  np.testing.assert_array_equal(
    q.apply(v, X, aqtr_key=k)[0], q.apply(v, X, aqtr_key=k)[0]
  )
  with pytest.raises(ValueError, match=r"^a/dot_general0 .*rngs=\{'aqtr'"):
    q.apply(v, X)


def test_op_key_folds_the_path():
  k = jax.random.key(0)
  a = aqtr.flax.rule_state.op_key(k, 'a/dot_general0')
  b = aqtr.flax.rule_state.op_key(k, 'b/dot_general0')
  assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_keys_on_a_mesh_give_each_shard_its_own_noise():
  """Under jit on a mesh the noise is drawn for the global array: the
  batch sharded over 8 devices rounds exactly as on one device, and rows
  that are equal (one per device) round differently."""
  if jax.device_count() < 8:
    pytest.skip('needs 8 (host) devices')
  q = aqtr.flax.quantize(Twin(), Rule(fwd_sr()))
  x = jnp.tile(X[:1], (8, 1))  # the same row on every device
  key = jax.random.key(3)
  run = jax.jit(lambda x: q(x, aqtr_key=key)[0])
  one = run(x)
  mesh = jax.make_mesh((8,), ('data',))
  sharded = jax.device_put(
    x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  )
  got = run(sharded)
  assert len(got.sharding.device_set) == 8
  np.testing.assert_array_equal(got, one)
  assert len({tuple(np.asarray(r).tolist()) for r in got}) > 1
