"""orbax checkpoints of QT params and low-bit optimizer states."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import qt
from aqtr.flax import checkpoint
from aqtr.qt.formats import dot_config


def _trained():
  params = {
    'Dense_0': {
      'kernel': jax.random.normal(jax.random.key(0), (64, 64)),
      'bias': jnp.zeros(64),
    },
    'Dense_1': {'kernel': jax.random.normal(jax.random.key(1), (64, 32))},
  }
  rules = [qt.Rule(pattern='Dense_1', fmt=qt.int4(32)), qt.Rule()]
  q, _ = qt.quantize_params(params, rules)
  tx = qt.quantized_training(qt.adamw_4bit(1e-2, min_size=0))
  state = tx.init(q)
  g = jax.tree.map(jnp.ones_like, qt.dequantize(q))
  step = jax.jit(lambda q, s: tx.update(g, s, q))
  for _ in range(2):
    u, state = step(q, state)
    q = qt.apply_updates(q, u)
  return q, state


def test_qt_params_and_lowbit_states_round_trip_bit_exactly(tmp_path):
  q, state = _trained()
  tree = {'params': q, 'opt_state': state}
  checkpoint.save(tmp_path / 'ckpt', tree)
  back = checkpoint.restore(tmp_path / 'ckpt', jax.eval_shape(lambda: tree))
  a, ta = jax.tree.flatten(tree)
  b, tb = jax.tree.flatten(back)
  assert ta == tb
  for x, y in zip(a, b, strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # No conversion: the restored int8 values are the rhs QTensor of the
  # serving dot, bit-exact with the QT forward (int8 x int8).
  w = back['params']['Dense_0']['kernel']
  assert w.qvalue.dtype == jnp.int8 and isinstance(w, qt.QTParam)
  x = jax.random.normal(jax.random.key(3), (4, 64))
  dn = (((1,), (0,)), ((), ()))
  cfg = dot_config(qt.int8())
  train_fwd = jax.jit(lambda x, w: aqtr.dot_general(x, w, dn, cfg))
  serve = aqtr.dot_general(x, w.qtensor(), dn, cfg)
  np.testing.assert_array_equal(
    train_fwd(x, q['Dense_0']['kernel'].dequant()), serve
  )


def test_restoring_into_another_format_names_the_leaf(tmp_path):
  # QT int8 params into an int4(32) target: "truncated or corrupted" before.
  w = {'kernel': jax.random.normal(jax.random.key(0), (64, 16))}
  q8, _ = qt.quantize_params(w)
  checkpoint.save(tmp_path / 'c', q8)
  q4, _ = qt.quantize_params(w, [qt.Rule(fmt=qt.int4(32))])
  with pytest.raises(
    checkpoint.CheckpointError,
    match=r"'kernel\.qvalue' is int8\[.*\] in the checkpoint but "
    r'uint8\[.*\] in the target',
  ):
    checkpoint.restore(tmp_path / 'c', jax.eval_shape(lambda: q4))
