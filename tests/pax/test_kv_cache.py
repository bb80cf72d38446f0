"""aqtr.pax.kv_cache: the config, codes + scales, int4 packing, reads."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.pax import kv_cache, ops
from aqtr.pax.kv_cache import KVCacheConfig


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'numerics': 'int3'}, r'KVCacheConfig.numerics must be one of'),
    ({'scales': 'row'}, r'KVCacheConfig.scales must be one of'),
    ({'calibration': 'mse'}, r'KVCacheConfig.calibration must be one of'),
    ({'read': 'fast'}, r'KVCacheConfig.read must be one of'),
    ({'block_size': 0}, r'KVCacheConfig.block_size must be an int >= 1'),
    ({'block_size': True}, r'KVCacheConfig.block_size must be an int >= 1'),
    ({'calibration': 'static'}, r'KVCacheConfig.bound must be a finite'),
    (
      {'calibration': 'static', 'bound': float('inf')},
      r'KVCacheConfig.bound must be a finite',
    ),
    (
      {'numerics': 'int4', 'read': 'int8_dots'},
      r"read='int8_dots' needs numerics='int8'",
    ),
  ],
)
def test_bad_config_is_one_clear_line(kwargs, match):
  with pytest.raises(ValueError, match=match) as e:
    KVCacheConfig(**kwargs)
  assert '\n' not in str(e.value)


def test_config_is_hashable_and_names_registry_numerics():
  cfg = KVCacheConfig(numerics='fp8')
  assert hash(cfg) == hash(KVCacheConfig(numerics='fp8'))
  assert cfg.numerics_of().max_value == 448.0
  assert KVCacheConfig(numerics='int4').numerics_of().max_value == 7.0
  assert not KVCacheConfig().quantized


@pytest.mark.parametrize(
  'kwargs, length, head_dim, match',
  [
    ({'numerics': 'int4'}, 8, 3, 'head_dim, which must be even'),
    ({'numerics': 'int8', 'scales': 'block'}, 10, 4, 'multiple of'),
  ],
)
def test_bad_cache_shape(kwargs, length, head_dim, match):
  with pytest.raises(ValueError, match=match):
    kv_cache.init_layer(
      KVCacheConfig(**kwargs),
      batch=1,
      length=length,
      num_heads=1,
      head_dim=head_dim,
    )


def _roundtrip(cfg, x, index=0, length=8):
  b, _, n, h = x.shape
  layer = kv_cache.init_layer(
    cfg, batch=b, length=length, num_heads=n, head_dim=h
  )
  layer = kv_cache.write(cfg, layer, x, x, jnp.int32(index))
  return layer, jnp.swapaxes(kv_cache.read(cfg, layer.k), 1, 2)  # [b,S,n,h]


def test_int4_codes_pack_two_per_byte_and_unpack_exactly():
  codes = np.arange(-7, 8, dtype=np.float32)  # 15 codes, scale 1 below.
  x = np.concatenate([codes, [7.0]]).reshape(1, 1, 1, 16)
  cfg = KVCacheConfig(numerics='int4')
  layer, back = _roundtrip(cfg, jnp.asarray(x), length=1)
  assert layer.k.codes.shape == (1, 1, 1, 8)  # [b, n, S, h/2]
  assert layer.k.codes.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(back), x)


@pytest.mark.parametrize(
  'numerics, rtol', [('int8', 1 / 254), ('int4', 1 / 14)]
)
def test_token_scales_round_to_half_a_step(numerics, rtol):
  x = jax.random.normal(jax.random.key(0), (2, 3, 2, 8))
  cfg = KVCacheConfig(numerics=numerics)
  layer, back = _roundtrip(cfg, x, index=2)
  bound = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  err = jnp.abs(back[:, 2:5] - x)
  assert bool(jnp.all(err <= bound * rtol * 1.0001))
  assert float(jnp.abs(back[:, :2]).max()) == 0.0  # Untouched slots.
  np.testing.assert_allclose(
    layer.k.scale[:, :, 2:5],
    jnp.swapaxes(bound[..., 0], 1, 2) / cfg.numerics_of().max_value,
  )


def test_fp8_codes_are_e4m3():
  x = jax.random.normal(jax.random.key(1), (1, 4, 2, 8))
  layer, back = _roundtrip(KVCacheConfig(numerics='fp8'), x)
  assert layer.k.codes.dtype == jnp.float8_e4m3fn
  np.testing.assert_allclose(back[:, :4], x, rtol=2**-4, atol=1e-6)


def test_block_scales_follow_the_blocks_absmax_as_tokens_arrive():
  cfg = KVCacheConfig(numerics='int8', scales='block', block_size=4)
  x = jax.random.normal(jax.random.key(2), (1, 8, 2, 8))
  layer = kv_cache.init_layer(cfg, batch=1, length=8, num_heads=2, head_dim=8)
  for i in range(6):  # One token at a time, requantizing its block.
    layer = kv_cache.write(
      cfg, layer, x[:, i : i + 1], x[:, i : i + 1], jnp.int32(i)
    )
  assert layer.k.scale.shape == (1, 2, 2)  # [b, n, blocks]
  bound0 = jnp.max(jnp.abs(x[:, :4]), axis=(1, 3))
  bound1 = jnp.max(jnp.abs(x[:, 4:6]), axis=(1, 3))
  np.testing.assert_allclose(layer.k.scale[..., 0], bound0 / 127, rtol=1e-5)
  np.testing.assert_allclose(layer.k.scale[..., 1], bound1 / 127, rtol=1e-5)
  back = jnp.swapaxes(kv_cache.read(cfg, layer.k), 1, 2)
  # Requantization may round a token twice: within one step of its block.
  step = jnp.repeat(jnp.swapaxes(layer.k.scale, 1, 2), 4, axis=1)[..., None]
  assert bool(jnp.all(jnp.abs(back[:, :6] - x[:, :6]) <= step[:, :6]))
  assert float(jnp.abs(back[:, 6:]).max()) == 0.0


def test_block_prefill_equals_blockwise_absmax():
  cfg = KVCacheConfig(numerics='int8', scales='block', block_size=4)
  x = jax.random.normal(jax.random.key(3), (2, 8, 1, 4))
  layer, back = _roundtrip(cfg, x)
  bound = jnp.max(jnp.abs(x.reshape(2, 2, 4, 1, 4)), axis=(2, 4))
  scale = jnp.swapaxes(layer.k.scale, 1, 2)  # [b, blocks, n]
  np.testing.assert_allclose(scale, bound / 127, rtol=1e-6)
  step = jnp.repeat(scale, 4, axis=1)[..., None] / 2
  assert bool(jnp.all(jnp.abs(back - x) <= step * 1.0001))


def test_static_bound_clips_and_keeps_one_scale():
  cfg = KVCacheConfig(numerics='int8', calibration='static', bound=2.0)
  x = jnp.array([0.5, -1.0, 3.0, -4.0]).reshape(1, 1, 1, 4)
  layer, back = _roundtrip(cfg, x, length=1)
  np.testing.assert_allclose(layer.k.scale, 2.0 / 127)
  np.testing.assert_allclose(back[0, 0, 0], [0.5, -1.0, 2.0, -2.0], atol=0.01)


def _attention_inputs(seed=4, t=2, s=8):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k1, (2, t, 2, 8)) * 8**-0.5
  k = jax.random.normal(k2, (2, s, 2, 8))
  v = jax.random.normal(k3, (2, s, 2, 8))
  mask = jnp.tril(jnp.ones((t, s), bool), s - t)[None, None]
  return q, k, v, jnp.broadcast_to(mask, (2, 1, t, s))


def _attend(cfg, q, k, v, mask):
  layer = kv_cache.init_layer(
    cfg, batch=2, length=k.shape[1], num_heads=2, head_dim=8
  )
  layer = kv_cache.write(cfg, layer, k, v, jnp.int32(0))
  return kv_cache.attend(cfg, layer, q, mask)


def test_int8_dots_are_integer_and_close_to_dequantizing():
  q, k, v, mask = _attention_inputs()
  dots = KVCacheConfig(numerics='int8', read='int8_dots')
  deq = KVCacheConfig(numerics='int8')
  ref = _attend(KVCacheConfig(), q, k, v, mask)
  a, b = _attend(dots, q, k, v, mask), _attend(deq, q, k, v, mask)
  assert float(jnp.abs(a - ref).max()) < 0.05
  assert float(jnp.abs(a - b).max()) < 0.05
  jaxpr = str(jax.make_jaxpr(lambda *a: _attend(dots, *a))(q, k, v, mask))
  assert jaxpr.count('preferred_element_type=int32') == 2, jaxpr
  assert jaxpr.count('i32[2,2,2,8] = dot_general') >= 1, jaxpr  # QK^T


def test_auto_read_takes_int8_dots_in_decode_steps_only():
  # The default read: int8 dots for one query (faster on XLA:CPU, where
  # dequantizing writes the float32 cache first), dequantize otherwise.
  auto = KVCacheConfig(numerics='int8')
  dots = KVCacheConfig(numerics='int8', read='int8_dots')
  deq = KVCacheConfig(numerics='int8', read='dequantize')
  step = _attention_inputs(t=1)
  np.testing.assert_array_equal(_attend(auto, *step), _attend(dots, *step))
  prefill = _attention_inputs(t=8)
  np.testing.assert_array_equal(_attend(auto, *prefill), _attend(deq, *prefill))
  int8_op = ops.EinsumOp(config=aqtr.presets.int8())
  assert kv_cache.reads_int8(auto, 1, ops.EinsumOp(), None)
  assert not kv_cache.reads_int8(auto, 1, int8_op, None)  # Its numerics.
  assert not kv_cache.reads_int8(KVCacheConfig(numerics='int4'), 1)
  assert not kv_cache.reads_int8(deq, 1)


def test_float_cache_attention_equals_plain_attention():
  q, k, v, mask = _attention_inputs(t=8)
  got = _attend(KVCacheConfig(), q, k, v, mask)
  logits = jnp.einsum('btnh,bsnh->bnts', q, k)  # The full forward's.
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  want = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits, -1), v)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  'kwargs, ratio',
  [
    ({'numerics': 'int8'}, (64 + 4) / 256),
    ({'numerics': 'int4'}, (32 + 4) / 256),
    ({'numerics': 'fp8'}, (64 + 4) / 256),
    (
      {'numerics': 'int8', 'scales': 'block', 'block_size': 16},
      0.25 + 1 / 1024,
    ),
    (
      {'numerics': 'int4', 'scales': 'block', 'block_size': 16},
      0.125 + 1 / 1024,
    ),
  ],
)
def test_bytes_per_token_against_float32(kwargs, ratio):
  def size(cfg):
    layer = kv_cache.init_layer(
      cfg, batch=2, length=32, num_heads=4, head_dim=64
    )
    return kv_cache.nbytes(layer)

  assert size(KVCacheConfig(**kwargs)) / size(KVCacheConfig()) == ratio


def test_int8_dots_of_one_query_equal_those_of_the_query_in_a_pair():
  # One query (decoding) runs as two (a zero row, for XLA:CPU's fast
  # integer kernel); the rows are independent, so results are equal.
  cfg = KVCacheConfig(numerics='int8', read='int8_dots')
  layer = kv_cache.init_layer(cfg, batch=1, length=8, num_heads=2, head_dim=4)
  kv = jax.random.normal(jax.random.key(0), (2, 1, 8, 2, 4))
  layer = kv_cache.write(cfg, layer, kv[0], kv[1], 0)
  q = jax.random.normal(jax.random.key(1), (1, 2, 2, 4))
  mask = jnp.ones((1, 1, 2, 8), bool)
  two = kv_cache.attend(cfg, layer, q, mask)
  one = kv_cache.attend(cfg, layer, q[:, :1], mask[:, :, :1])
  np.testing.assert_array_equal(one, two[:, :1])
  f = jax.jit(lambda q: kv_cache.attend(cfg, layer, q, mask[:, :, :1]))
  text = f.lower(q[:, :1]).compile().as_text().splitlines()
  dots = [x for x in text if ' dot(' in x]  # [..., 2 queries, F]
  assert dots and all(re.search(r's32\[[\d,]*2,\d+\]', d) for d in dots)


def test_tiny_keys_keep_the_core_s_smallest_normal_scale():
  # bound / 127 below float32's smallest normal (bound < 1.5e-36) used to
  # flush to 0 on XLA:CPU: the scale fell back to 1 and every key was
  # stored as code 0. The core's scale stays normal (aqtr.core.scale).
  x = 1e-37 * jax.random.normal(jax.random.key(3), (1, 4, 2, 8))
  layer, back = _roundtrip(KVCacheConfig(numerics='int8'), x)
  tiny = float(jnp.finfo(jnp.float32).tiny)
  assert float(jnp.abs(back[:, :4] - x).max()) <= tiny
  assert int(jnp.abs(layer.k.codes).max()) > 1


def test_a_float_cache_write_is_differentiable():
  # The write's fusion boundary (a while loop on CPU) is the identity to
  # differentiation.
  cfg = KVCacheConfig()
  layer = kv_cache.init_layer(cfg, batch=1, length=4, num_heads=1, head_dim=2)

  def f(x):
    out = kv_cache.write(cfg, layer, 3 * x, x, jnp.int32(1))
    return out.k.codes.sum() + 2 * out.v.codes.sum()

  x = jnp.ones((1, 1, 1, 2))
  np.testing.assert_array_equal(jax.grad(f)(x), np.full(x.shape, 5.0))
  np.testing.assert_array_equal(jax.jit(jax.grad(f))(x), np.full(x.shape, 5.0))


@pytest.mark.parametrize('numerics', ['int8', 'int4', 'fp8'])
@pytest.mark.parametrize('scales', ['token', 'block'])
@pytest.mark.parametrize('tokens', [1, 512])  # 512: past XLA:CPU's library.
def test_a_nan_key_reads_back_nan_not_a_finite_value(numerics, scales, tokens):
  # The group holding the NaN reads back all NaN (a float cache would give
  # NaN attention); the other groups stay finite. XLA:CPU's library max
  # skips NaN on large operands: the cache's absmax must not.
  cfg = KVCacheConfig(numerics=numerics, scales=scales, block_size=16)
  b, n, h = 2, 4, 64
  k = jax.random.normal(jax.random.key(0), (b, tokens, n, h))
  k = k.at[1, 0, 2, 5].set(jnp.nan)
  layer = kv_cache.init_layer(
    cfg, batch=b, length=max(tokens, 16), num_heads=n, head_dim=h
  )
  layer = jax.jit(lambda lay, k: kv_cache.write(cfg, lay, k, k, 0))(layer, k)
  got = np.asarray(kv_cache.read(cfg, layer.k))  # [b, n, S, h]
  group = slice(0, 16) if scales == 'block' else slice(0, 1)
  assert np.isnan(got[1, 2, group, :]).all()
  assert np.isnan(got).sum() == got[1, 2, group, :].size


@pytest.mark.parametrize('batch', [1, 8])  # 8: 4096 query values.
def test_int8_dots_give_nan_for_a_nan_query(batch):
  # The query's int8 rows: a NaN query gives NaN attention (as float).
  cfg = KVCacheConfig(numerics='int8', read='int8_dots')
  n, h, s = 8, 64, 16
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(k1, (batch, 1, n, h)).at[0, 0, 3, 5].set(jnp.nan)
  k = jax.random.normal(k2, (batch, s, n, h))
  v = jax.random.normal(k3, (batch, s, n, h))
  mask = jnp.ones((batch, 1, 1, s), bool)
  layer = kv_cache.init_layer(
    cfg, batch=batch, length=s, num_heads=n, head_dim=h
  )
  layer = kv_cache.write(cfg, layer, k, v, jnp.int32(0))
  out = jax.jit(lambda *a: kv_cache.attend(cfg, *a))(layer, q, mask)
  out = np.asarray(out).reshape(batch, n, h)  # [b, t, n, h]
  assert np.isnan(out[0, 3]).all()
  assert np.isnan(out).sum() == h
