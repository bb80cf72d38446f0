"""orbax round trips of serving trees: restored serving output identical."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax_cases import LinenCNN, LinenMLP, NnxMLP, bitwise, digits

import aqtr
import aqtr.flax.checkpoint as ckpt
import aqtr.flax.linen as ql
import aqtr.flax.nnx as qn
from aqtr.freezers import Mode


def _cfg(preset=aqtr.presets.int8):
  return aqtr.freezers.configure(preset(), rhs='weights')


def _abstract_serving(model_cls, cfg, x):
  """The serving tree's structure, without training or real values."""
  v = jax.eval_shape(model_cls(cfg).init, jax.random.key(0), x)
  return jax.eval_shape(
    lambda v: ql.convert(model_cls(cfg, Mode.CONVERT), v, x), v
  )


@pytest.mark.parametrize(
  'model_cls,preset',
  [(LinenMLP, aqtr.presets.int8), (LinenCNN, aqtr.presets.int4_weight_only)],
)
def test_linen_round_trip(tmp_path, model_cls, preset):
  cfg = _cfg(preset)
  x, _ = digits(16)
  v = jax.jit(model_cls(cfg).init)(jax.random.key(0), x)
  serving = ql.convert(model_cls(cfg, Mode.CONVERT), v, x)
  ckpt.save(tmp_path / 'serving', serving)
  restored = ckpt.restore(
    tmp_path / 'serving', _abstract_serving(model_cls, cfg, x)
  )
  assert jax.tree.structure(restored) == jax.tree.structure(serving)
  jax.tree.map(bitwise, restored, serving)
  jax.tree.map(
    lambda a, b: a.dtype == b.dtype or pytest.fail(), restored, serving
  )
  serve = jax.jit(model_cls(cfg, Mode.SERVE).apply)
  bitwise(serve(restored, x), serve(serving, x))


def test_nnx_round_trip(tmp_path):
  cfg = _cfg()
  x, _ = digits(16)
  m = qn.convert(NnxMLP(cfg, nnx.Rngs(0)), x)
  ckpt.save(tmp_path / 'serving', nnx.state(m))
  abstract = nnx.eval_shape(lambda: qn.convert(NnxMLP(cfg, nnx.Rngs(1)), x))
  graphdef, target = nnx.split(abstract)
  restored = nnx.merge(graphdef, ckpt.restore(tmp_path / 'serving', target))
  forward = nnx.jit(lambda m, x: m(x))
  bitwise(forward(restored, x), forward(m, x))


def test_restoring_under_another_config_is_reported(tmp_path):
  x, _ = digits(16)
  cfg = _cfg()
  v = jax.jit(LinenMLP(cfg).init)(jax.random.key(0), x)
  ckpt.save(tmp_path / 's', ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x))
  other = _abstract_serving(LinenMLP, _cfg(aqtr.presets.int8_weight_only), x)
  with pytest.raises(ValueError, match='different forward quantization'):
    ckpt.restore(tmp_path / 's', other)
  with pytest.raises(ValueError, match='does not match the target'):
    ckpt.restore(tmp_path / 's', {'w': jnp.zeros(2)})
  with pytest.raises(ValueError):  # an existing directory is not replaced
    ckpt.save(tmp_path / 's', {'w': jnp.zeros(2)})
  ckpt.save(tmp_path / 's', {'w': jnp.ones(2)}, force=True)
  bitwise(ckpt.restore(tmp_path / 's', {'w': jnp.zeros(2)})['w'], jnp.ones(2))


class _Dense(nn.Module):
  features: int
  config: aqtr.DotGeneralConfig
  mode: Mode = Mode.TRAIN

  @nn.compact
  def __call__(self, x):
    dg = functools.partial(ql.DotGeneral, config=self.config, mode=self.mode)
    return nn.Dense(self.features, dot_general_cls=dg)(x)


def test_restoring_into_other_shapes_names_the_leaf(tmp_path):
  # A Dense(16) serving tree into a Dense(8) target used to be reported
  # as "truncated or corrupted"; the files are intact.
  cfg, x = _cfg(), jnp.ones((2, 32))

  def serving(n):
    v = jax.eval_shape(_Dense(n, cfg).init, jax.random.key(0), x)
    return jax.eval_shape(
      lambda v: ql.convert(_Dense(n, cfg, Mode.CONVERT), v, x), v
    )

  v = _Dense(16, cfg).init(jax.random.key(0), x)
  ckpt.save(tmp_path / 's', ql.convert(_Dense(16, cfg, Mode.CONVERT), v, x))
  with pytest.raises(
    ckpt.CheckpointError,
    match=r"'aqtr\.Dense_0\..*rhs\.qvalue' is int8\[1, 1, 16, 32\] in the "
    r'checkpoint but int8\[1, 1, 8, 32\] in the target.*\(and 1 more\)\. '
    'The files are intact',
  ):
    ckpt.restore(tmp_path / 's', serving(8))
  ckpt.restore(tmp_path / 's', serving(16))
  with pytest.raises(ckpt.CheckpointError, match=r"'w' is int8\[2\].*float32"):
    ckpt.save(tmp_path / 'w', {'w': jnp.ones(2, jnp.int8)})
    ckpt.restore(tmp_path / 'w', {'w': jnp.ones(2)})


def test_a_tree_saved_in_the_view_as_quantized_names_the_layout(tmp_path):
  # Serving trees saved before int8-dot weights were stored [.., N, K]
  # hold them [.., K, N]: restoring one into a model converted now names
  # the layout change and the fix, not only the shapes.
  cfg, x = _cfg(), jnp.ones((2, 32))
  v = _Dense(16, cfg).init(jax.random.key(0), x)
  served = ql.convert(_Dense(16, cfg, Mode.CONVERT), v, x)

  def as_quantized(path, a):
    name = jax.tree_util.keystr(path)
    if "['rhs']" in name and ("'qvalue'" in name or "'scale'" in name):
      return jnp.swapaxes(a, -1, -2)
    return a

  old = jax.tree_util.tree_map_with_path(as_quantized, served)
  ckpt.save(tmp_path / 'old', old)
  with pytest.raises(
    ckpt.CheckpointError,
    match=r'rhs\.scale. is float32\[1, 1, 1, 16\] in the checkpoint but '
    r'float32\[1, 1, 16, 1\] in the target.*contraction minor.*convert the '
    'model again',
  ):
    ckpt.restore(tmp_path / 'old', jax.eval_shape(lambda: served))
