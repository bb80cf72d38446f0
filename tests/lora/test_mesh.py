"""QLoRA on a data x model mesh of 8 host devices (tests/conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from aqtr import lora

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason='needs 8 host devices (tests/conftest.py)'
)


def test_qlora_step_on_a_data_model_mesh_matches_one_device():
  x = jax.random.normal(jax.random.key(1), (8, 128))
  m = lora.attach(
    nnx.Linear(128, 64, rngs=nnx.Rngs(0)),
    lora.LoraConfig(rank=4, base='nf4', double_quant=True),
    x[:1],
  )
  b = m.lora_b_dot_general0
  b.set_value(0.1 * jax.random.normal(jax.random.key(2), b.get_value().shape))
  graphdef, ad, rest = nnx.split(m, lora.Adapter, ...)

  def step(ad, rest, x):
    def loss(ad):
      return jnp.mean(nnx.merge(graphdef, ad, rest)(x) ** 2)

    value, g = jax.value_and_grad(loss)(ad)
    return value, g

  want_v, want_g = jax.jit(step)(ad, rest, x)
  mesh = jax.make_mesh((4, 2), ('data', 'model'))

  def spec(path, leaf):
    name = str(path)
    if 'lora_b' in name or 'table4' in name:  # B, the packed nf4 codes.
      return NamedSharding(mesh, P(*([None] * (leaf.ndim - 1)), 'model'))
    return NamedSharding(mesh, P())

  ad_s = jax.device_put(ad, jax.tree_util.tree_map_with_path(spec, ad))
  rest_s = jax.device_put(rest, jax.tree_util.tree_map_with_path(spec, rest))
  x_s = jax.device_put(x, NamedSharding(mesh, P('data', None)))
  got_v, got_g = jax.jit(step)(ad_s, rest_s, x_s)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  # The adapter B and the nf4 codes really were split over 'model'.
  specs = [str(a.sharding.spec) for a in jax.tree.leaves((ad_s, rest_s))]
  assert sum('model' in s for s in specs) == 2


def test_pax_qlora_step_on_a_data_model_mesh_matches_one_device():
  import fiddle as fdl  # noqa: PLC0415

  from aqtr.train import mesh as mesh_lib  # noqa: PLC0415
  from aqtr.train import models  # noqa: PLC0415

  t = models.lm(64, 8, d_model=64, num_layers=1, num_heads=2, mlp_ratio=2)
  x = (jnp.arange(64).reshape(8, 8) * 5) % 64
  v = jax.jit(fdl.build(t).init)(jax.random.key(0), x[:1])
  cfg = lora.LoraConfig(rank=4, base='nf4', double_quant=True)
  lt, lv = lora.attach(t, {'layers.*': cfg}, x[:1], variables=v)
  module = fdl.build(lt)
  ad, frozen = lora.partition(lv['params'])
  ad = jax.tree.map(lambda a: a + 0.01, ad)  # B != 0
  rest = dict(lv, params=frozen)

  def step(ad, rest, x):
    def loss(ad):
      out = module.apply(dict(rest, params=lora.combine(ad, rest['params'])), x)
      return jnp.mean(out**2)

    return jax.value_and_grad(loss)(ad)

  want_v, want_g = jax.jit(step)(ad, rest, x)
  mesh = mesh_lib.make((4, 2))  # The job's mesh (auto axes).
  # As the job shards: every leaf's last axis over 'model' where it
  # divides (adapters B, the nf4 codes, the scales), the batch over 'data'.
  ad_s = jax.device_put(ad, mesh_lib.param_shardings(mesh, ad))
  rest_s = jax.device_put(rest, mesh_lib.param_shardings(mesh, rest))
  x_s = jax.device_put(x, mesh_lib.batch_sharding(mesh))
  got_v, got_g = jax.jit(step)(ad_s, rest_s, x_s)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  codes = [
    a
    for a in jax.tree.leaves(rest_s)
    if a.dtype == jnp.uint8 and 'model' in str(a.sharding.spec)
  ]
  assert len(codes) == 6  # Every nf4 base, split over 'model'.
