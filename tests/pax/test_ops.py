"""Injectable ops: float default is exact, configs route through aqtr."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
import aqtr.pax
from aqtr.pax import ops

X = jax.random.normal(jax.random.key(0), (2, 3, 8))
W = jax.random.normal(jax.random.key(1), (8, 5))


def test_float_einsum_is_jnp_einsum_bit_for_bit():
  got = ops.EinsumOp().apply({}, '...d,df->...f', X, W)
  np.testing.assert_array_equal(got, jnp.einsum('...d,df->...f', X, W))
  np.testing.assert_array_equal(
    ops.einsum(None, 'btd,df->btf', X, W), jnp.einsum('btd,df->btf', X, W)
  )


def test_quantized_einsum_matches_aqtr_einsum():
  cfg = aqtr.presets.int8()
  got = ops.EinsumOp(config=cfg).apply({}, 'btd,df->btf', X, W)
  want = aqtr.einsum('btd,df->btf', X, W, config=cfg)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, jnp.einsum('btd,df->btf', X, W))


def test_quantized_einsum_with_ellipsis_on_one_operand():
  cfg = aqtr.presets.int8()
  got = ops.EinsumOp(config=cfg).apply({}, '...d,df->...f', X, W)
  want = aqtr.einsum('btd,df->btf', X, W, config=cfg)
  np.testing.assert_array_equal(got, want)


def test_dot_general_op():
  dn = (((2,), (0,)), ((), ()))
  np.testing.assert_array_equal(
    ops.DotGeneralOp().apply({}, X, W, dn), lax.dot_general(X, W, dn)
  )
  cfg = aqtr.presets.int8()
  np.testing.assert_array_equal(
    ops.DotGeneralOp(config=cfg).apply({}, X, W, dn),
    aqtr.dot_general(X, W, dn, cfg),
  )


def test_conv_op_float_and_quantized_path():
  x = jax.random.normal(jax.random.key(2), (1, 6, 6, 2))
  k = jax.random.normal(jax.random.key(3), (3, 3, 2, 4))
  dn = ('NHWC', 'HWIO', 'NHWC')
  want = lax.conv_general_dilated(x, k, (1, 1), 'SAME', dimension_numbers=dn)
  got = ops.ConvOp().apply({}, x, k, (1, 1), 'SAME', dimension_numbers=dn)
  np.testing.assert_array_equal(got, want)
  # The quantized path (aqtr.conv_general_dilated) is exercised by
  # test_classifier.py; here only that it is taken.
  op = ops.ConvOp(config=aqtr.presets.int8())
  jaxpr = jax.make_jaxpr(
    lambda x, k: op.apply({}, x, k, (1, 1), 'SAME', dimension_numbers=dn)
  )(x, k)
  assert 'conv_general_dilated' not in str(jaxpr)
  assert 'i8' in str(jaxpr)


def test_needs_key():
  assert not ops.needs_key(None)
  assert not ops.needs_key(aqtr.presets.int8())
  assert ops.needs_key(aqtr.presets.fully_quantized(8, 8, True))


def test_stochastic_rounding_key_comes_from_the_quant_stream():
  cfg = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
  op = ops.EinsumOp(config=cfg)
  with pytest.raises(ValueError, match=r"rng stream 'quant'.*rngs="):
    op.apply({}, 'md,df->mf', X[0], W)

  def grad(seed):
    def f(x):
      y = op.apply({}, 'md,df->mf', x, W, rngs={'quant': jax.random.key(seed)})
      return jnp.sum(y * y)

    return jax.grad(f)(X[0])

  np.testing.assert_array_equal(grad(0), grad(0))
  assert not np.array_equal(grad(0), grad(1))


def test_custom_stream_name():
  cfg = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
  op = ops.EinsumOp(config=cfg, rng_stream='noise')
  with pytest.raises(ValueError, match="'noise'"):
    op.apply({}, 'md,df->mf', X[0], W, rngs={'quant': jax.random.key(0)})
  op.apply({}, 'md,df->mf', X[0], W, rngs={'noise': jax.random.key(0)})


def test_float_op_needs_no_rng():
  cfg = aqtr.presets.int8()  # Rounds to nearest: no stream is needed.
  got = ops.EinsumOp(config=cfg).apply({}, 'md,df->mf', X[0], W, rngs={})
  np.testing.assert_array_equal(
    got, aqtr.einsum('md,df->mf', X[0], W, config=cfg)
  )
  assert not np.array_equal(got, X[0] @ W)  # quantized, not float


def test_op_fields_from_annotations():
  assert ops.op_fields(aqtr.pax.Linear) == {'einsum': ops.EinsumOp}
  assert ops.op_fields(aqtr.pax.Conv) == {'conv': ops.ConvOp}
  assert set(ops.op_fields(aqtr.pax.Attention)) == {'qk_einsum', 'pv_einsum'}
  assert ops.op_fields(aqtr.pax.Block) == {}

  class Mine(nn.Module):
    a: ops.DotGeneralOp | None = None
    b: int = 0

  assert ops.op_fields(Mine) == {'a': ops.DotGeneralOp}


def test_ops_hold_no_parameters():
  variables = ops.EinsumOp(config=aqtr.presets.int8()).init(
    jax.random.key(0), 'md,df->mf', X[0], W
  )
  assert variables == {}
  assert dataclasses.is_dataclass(ops.EinsumOp)
