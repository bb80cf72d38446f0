"""Only the adapters train: masks, partition, optimizers, refusals."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from aqtr import lora

X = jax.random.normal(jax.random.key(1), (8, 64))
Y = jax.random.normal(jax.random.key(2), (8, 8))


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.relu(nn.Dense(64)(x)))


def _linen(base='nf4'):
  m = _Mlp()
  v = m.init(jax.random.key(0), X)
  return lora.attach(m, lora.LoraConfig(rank=4, base=base), X, variables=v)


def test_linen_optimizer_trains_adapters_only():
  lm, lv = _linen(base=None)  # float base: its kernel would be trainable
  params = lv['params']
  tx = lora.optimizer(optax.adam(1e-2))
  opt = tx.init(params)

  def loss(p):
    return jnp.mean((lm.apply({'params': p}, X) - Y) ** 2)

  @jax.jit
  def step(p, opt):
    value, g = jax.value_and_grad(loss)(p)
    upd, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, upd), opt, value

  first = None
  p = params
  for _ in range(20):
    p, opt, value = step(p, opt)
    first = value if first is None else first
  assert float(value) < float(first)
  mask = lora.trainable(params)
  for changed, m in zip(
    jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), p, params)),
    jax.tree.leaves(mask),
    strict=True,
  ):
    assert changed == m or (m and not changed)
  assert not any(
    bool((a != b).any())
    for a, b, m in zip(
      jax.tree.leaves(p),
      jax.tree.leaves(params),
      jax.tree.leaves(mask),
      strict=True,
    )
    if not m
  )


def test_partition_differentiates_the_adapters_of_a_quantized_base():
  lm, lv = _linen()
  ad, frozen = lora.partition(lv['params'])
  assert set(jax.tree.leaves(jax.tree.map(lambda _: 1, ad))) == {1}
  tx = optax.adam(1e-2)
  opt = tx.init(ad)

  @jax.jit
  def step(ad, opt):
    def loss(ad):
      y = lm.apply({'params': lora.combine(ad, frozen)}, X)
      return jnp.mean((y - Y) ** 2)

    value, g = jax.value_and_grad(loss)(ad)
    upd, opt = tx.update(g, opt, ad)
    return optax.apply_updates(ad, upd), opt, value

  values = []
  for _ in range(15):
    ad, opt, value = step(ad, opt)
    values.append(float(value))
  assert values[-1] < values[0]


def test_a_trainable_base_is_refused_one_line():
  lm, lv = _linen(base=None)
  params = lv['params']
  mask = jax.tree.map(lambda _: True, params)
  with pytest.raises(
    ValueError, match=r"base weight 'Dense_0/bias' is trainable"
  ) as e:
    lora.optimizer(optax.adam(1e-3), mask=mask).init(params)
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match='nothing is trainable'):
    lora.check(params, jax.tree.map(lambda _: False, params))
  with pytest.raises(ValueError, match='no adapter in the params'):
    lora.partition({'dense': {'kernel': jnp.ones(2)}})


def test_nnx_optimizer_and_its_refusal():
  m = lora.attach(
    nnx.Linear(64, 8, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=2), X
  )
  opt = lora.nnx_optimizer(m, optax.adam(1e-2))
  kernel = m.kernel.get_value()

  @nnx.jit
  def step(m, opt):
    def loss(m):
      return jnp.mean((m(X) - Y) ** 2)

    value, g = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, lora.Adapter))(
      m
    )
    opt.update(m, g)
    return value

  v0 = step(m, opt)
  for _ in range(10):
    v = step(m, opt)
  assert float(v) < float(v0)
  np.testing.assert_array_equal(m.kernel.get_value(), kernel)
  with pytest.raises(
    ValueError, match=r"base weight 'bias' \(Param\) is trainable under wrt="
  ):
    lora.nnx_optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
  with pytest.raises(ValueError, match='selects no adapter'):
    lora.check_nnx(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
