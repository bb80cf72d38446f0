"""nnx on the 8-device host mesh: partitioned params keep their sharding.

TRAIN: values and gradients equal the unsharded layer's (kernel gradient
bit for bit: its int8 dots accumulate exactly), gradients sharded like the
params. CONVERT: the frozen int8 values and scales are sharded like the
float kernel ('model' on the output features). SERVE: output equal to the
TRAIN output. orbax restores the frozen tree sharded (target: the live
model's ShapeDtypeStructs with their shardings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import aqtr
import aqtr.flax.checkpoint as ckpt
import aqtr.flax.nnx as qn

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason='needs 8 host devices (tests/conftest.py)'
)


def _layer(partitioned: bool) -> nnx.Linear:
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  init = nnx.initializers.lecun_normal()
  if partitioned:
    init = nnx.with_partitioning(init, (None, 'model'))
  return nnx.Linear(
    16, 32, dot_general=qn.DotGeneral(cfg), kernel_init=init, rngs=nnx.Rngs(0)
  )


def _loss(m, x):
  return jnp.sum(m(x) ** 2)


def test_nnx_train_convert_serve_restore_keep_sharding(tmp_path):
  x = jax.random.normal(jax.random.key(1), (8, 16))
  want_loss, want_grad = nnx.value_and_grad(_loss)(_layer(False), x)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))  # Explicit axes.
  with jax.set_mesh(mesh):
    m = _layer(True)
    xs = jax.device_put(x, P('data'))
    loss, grad = nnx.jit(nnx.value_and_grad(_loss))(m, xs)
    assert jax.typeof(grad.kernel[...]).sharding.spec == P(None, 'model')
    y_train = nnx.jit(lambda m, a: m(a))(m, xs)
    qn.convert(m, xs)
    frozen = {
      jax.tree_util.keystr(p): v
      for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(m))
      if 'frozen' in jax.tree_util.keystr(p)
    }
    y_serve = nnx.jit(lambda m, a: m(a))(m, xs)
    ckpt.save(tmp_path / 'serving', nnx.state(m))
    graphdef, state = nnx.split(m)
    target = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state,
    )
    restored = nnx.merge(graphdef, ckpt.restore(tmp_path / 'serving', target))
    y_restored = nnx.jit(lambda m, a: m(a))(restored, xs)
    restored_specs = {
      jax.tree_util.keystr(p): jax.typeof(v).sharding.spec
      for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(restored))
      if 'frozen' in jax.tree_util.keystr(p)
    }
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_array_equal(grad.kernel[...], want_grad.kernel[...])
  assert sorted(k.rsplit("'", 2)[-2] for k in frozen) == ['qvalue', 'scale']
  for k, v in frozen.items():  # Stored [.., N, K]: N is the one before last.
    spec = jax.typeof(v).sharding.spec
    assert (*spec, *[None] * (v.ndim - len(spec)))[-2] == 'model', k
    assert restored_specs[k] == jax.typeof(v).sharding.spec, k
  assert frozen[next(k for k in frozen if 'qvalue' in k)].dtype == jnp.int8
  np.testing.assert_array_equal(y_serve, y_train)
  np.testing.assert_array_equal(y_restored, y_serve)
