"""linen on the 8-device host mesh: partitioned params keep their sharding.

Auto axes: the kernel is `nn.with_partitioning(init, (None, 'model'))`,
the variables are made with the shardings of `nn.get_partition_spec`
(flax's recipe; flax's `Partitioned` boxes assert their sharding with
`with_sharding_constraint`, which explicit axes refuse, so linen's boxes
need auto axes). Explicit axes: the same layer with plain params placed
with `jax.device_put`.

TRAIN: values and gradients equal the unsharded layer's (kernel gradient
bit for bit: its int8 dots accumulate exactly), gradients sharded like the
params. CONVERT: the frozen int8 values and scales are sharded like the
float kernel ('model' on the output features). SERVE: output equal to the
TRAIN output. orbax restores the serving tree sharded.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import aqtr
import aqtr.flax.checkpoint as ckpt
import aqtr.flax.linen as ql
from aqtr.flax.frozen import is_removed

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason='needs 8 host devices (tests/conftest.py)'
)

CFG = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
KERNEL = P(None, 'model')


def _layer(mode, partitioned=False):
  init = nn.initializers.lecun_normal()
  if partitioned:
    init = nn.with_partitioning(init, tuple(KERNEL))
  op = functools.partial(ql.DotGeneral, config=CFG, mode=mode)
  return nn.Dense(32, kernel_init=init, dot_general_cls=op)


def _loss(v, x):
  return jnp.sum(_layer(ql.Mode.TRAIN).apply(v, x) ** 2)


def _variables(mesh, kind, x):
  """TRAIN variables, sharded: linen's boxes (auto) or device_put."""
  if kind == 'auto':
    m = _layer(ql.Mode.TRAIN, partitioned=True)
    specs = nn.get_partition_spec(jax.eval_shape(m.init, jax.random.key(0), x))
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(m.init, out_shardings=out)(jax.random.key(0), x)
  v = _layer(ql.Mode.TRAIN).init(jax.random.key(0), x)
  return jax.device_put(v, {'params': {'bias': P(), 'kernel': KERNEL}})


def _frozen(tree):
  return {
    jax.tree_util.keystr(p): a
    for p, a in jax.tree_util.tree_leaves_with_path(tree['aqtr'])
  }


@pytest.mark.parametrize('kind', ['auto', 'explicit'])
def test_linen_train_convert_serve_restore_keep_sharding(kind, tmp_path):
  x = jax.random.normal(jax.random.key(1), (8, 16))
  v0 = _layer(ql.Mode.TRAIN).init(jax.random.key(0), x)
  want_loss, want_grad = jax.value_and_grad(_loss)(v0, x)
  axis_type = AxisType.Auto if kind == 'auto' else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    v = _variables(mesh, kind, x)
    xs = jax.device_put(x, NamedSharding(mesh, P('data')))
    loss, grad = jax.jit(jax.value_and_grad(_loss))(v, xs)
    y_train = jax.jit(_layer(ql.Mode.TRAIN).apply)(v, xs)

    def convert(v):
      return ql.convert(_layer(ql.Mode.CONVERT), v, xs)

    serving = convert(v)
    y_serve = jax.jit(_layer(ql.Mode.SERVE).apply)(serving, xs)
    ckpt.save(tmp_path / 'serving', serving)
    # A serving process restores onto the shardings of the live tree (auto:
    # the compiler placed them) or of the tree's types (explicit: known
    # without running the conversion).
    if kind == 'auto':
      target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        serving,
      )
    else:
      target = jax.eval_shape(convert, v)
    restored = ckpt.restore(tmp_path / 'serving', target)
    y_restored = jax.jit(_layer(ql.Mode.SERVE).apply)(restored, xs)
  kernel_grad = nn.meta.unbox(grad['params']['kernel'])
  assert kernel_grad.sharding.spec == KERNEL
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_array_equal(kernel_grad, want_grad['params']['kernel'])
  frozen, back = _frozen(serving), _frozen(restored)
  assert sorted(k.rsplit("'", 2)[-2] for k in frozen) == ['qvalue', 'scale']
  for k, a in frozen.items():  # Stored [.., N, K]: N is the one before last.
    spec = (*a.sharding.spec, *[None] * (a.ndim - len(a.sharding.spec)))
    assert spec[-2] == 'model', (k, a.sharding)
    assert back[k].sharding.is_equivalent_to(a.sharding, a.ndim), k
    np.testing.assert_array_equal(back[k], a)
  assert frozen[next(k for k in frozen if 'qvalue' in k)].dtype == jnp.int8
  assert is_removed(serving['params']['kernel'])
  np.testing.assert_array_equal(y_serve, y_train)
  np.testing.assert_array_equal(y_restored, y_serve)
