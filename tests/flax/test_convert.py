"""Conversion to serving trees: sizes, no float kernels, abstract convert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_cases import LinenCNN, LinenMLP, NnxMLP, bitwise, digits

import aqtr
import aqtr.flax.linen as ql
import aqtr.flax.nnx as qn
from aqtr.flax.frozen import is_removed
from aqtr.freezers import Mode

# preset -> (config, stored values' key and dtype, kernel ratio): int4
# values are stored as packed 4-bit codes (`aqtr.core.codecs`).
PRESETS = {
  'int8': (aqtr.presets.int8, ('qvalue', jnp.int8), 0.3),
  'int4': (aqtr.presets.int4_weight_only, ('int4', jnp.uint8), 0.16),
  'w4a8': (aqtr.presets.w4a8, ('int4', jnp.uint8), 0.16),
}


def _cfg(preset):
  return aqtr.freezers.configure(PRESETS[preset][0](), rhs='weights')


def _linen(model_cls, preset):
  cfg = _cfg(preset)
  x, _ = digits(16)
  v = jax.jit(model_cls(cfg).init)(jax.random.key(0), x)
  serving = ql.convert(model_cls(cfg, Mode.CONVERT), v, x)
  return cfg, x, v, serving


@pytest.mark.parametrize('preset', sorted(PRESETS))
@pytest.mark.parametrize('model_cls', [LinenMLP, LinenCNN])
def test_linen_serving_tree_holds_int_kernels_only(model_cls, preset):
  cfg, x, v, serving = _linen(model_cls, preset)
  _, dtype, ratio = PRESETS[preset]
  floats = [
    a
    for a in jax.tree_util.tree_leaves(serving['params'])
    if jnp.issubdtype(a.dtype, jnp.floating)
  ]
  assert all(a.ndim == 1 for a in floats)  # biases only
  key, dtype = dtype
  qvalues = [
    a
    for p, a in jax.tree_util.tree_leaves_with_path(serving[ql.FROZEN])
    if f"'{key}'" in jax.tree_util.keystr(p)
  ]
  assert qvalues and all(a.dtype == dtype for a in qvalues)
  r = aqtr.flax.sizes((model_cls(cfg, Mode.SERVE), serving))
  kernels = [
    a
    for p, a in jax.tree_util.tree_leaves_with_path(v['params'])
    if 'kernel' in jax.tree_util.keystr(p)
  ]
  assert r.float_kernel_bytes == sum(a.nbytes for a in kernels)
  assert r.kernel_ratio <= ratio, str(r)
  assert r.serving_bytes < aqtr.freezers.lifecycle.nbytes(v) * ratio + 200
  bitwise(
    jax.jit(model_cls(cfg, Mode.SERVE).apply)(serving, x),
    jax.jit(model_cls(cfg).apply)(v, x),
  )


def test_compiled_serving_never_materializes_a_float_kernel():
  cfg, x, v, serving = _linen(LinenMLP, 'int8')
  text = jax.jit(LinenMLP(cfg, Mode.SERVE).apply).lower(serving, x).as_text()
  assert 'tensor<64x128xf32>' not in text and 'tensor<128x10xf32>' not in text
  assert 'tensor<1x1x128x64xi8>' in text  # qvalues enter as int8 [N, K]
  train = jax.jit(LinenMLP(cfg).apply).lower(v, x).as_text()
  assert 'tensor<64x128xf32>' in train


def test_abstract_conversion_gives_the_serving_structure():
  cfg, x, v, serving = _linen(LinenMLP, 'int8')
  abstract_v = jax.eval_shape(LinenMLP(cfg).init, jax.random.key(0), x)
  abstract = jax.eval_shape(
    lambda v: ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x), abstract_v
  )
  assert jax.tree.structure(abstract) == jax.tree.structure(serving)
  jax.tree.map(
    lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype) or pytest.fail(),
    abstract,
    serving,
  )


def test_nnx_serving_state_holds_int_kernels_only():
  cfg = _cfg('int8')
  x, _ = digits(16)
  m = NnxMLP(cfg, nnx.Rngs(0))
  float_bytes = aqtr.freezers.lifecycle.nbytes(nnx.state(m))
  forward = nnx.jit(lambda m, x: m(x))
  train = forward(m, x)
  qn.convert(m, x)
  r = aqtr.flax.sizes(m)
  assert r.kernel_ratio <= 0.3, str(r)
  assert r.serving_bytes < 0.3 * float_bytes
  state = nnx.state(m)
  kernels = jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))
  assert all(a.ndim == 1 for a in kernels)  # biases only
  removed = [v for _, v in nnx.iter_graph(m) if is_removed(v)]
  assert removed and all(v.stored() is None for v in removed)  # no arrays
  bitwise(forward(m, x), train)
  abstract = nnx.eval_shape(lambda: qn.convert(NnxMLP(cfg, nnx.Rngs(0)), x))
  assert jax.tree.structure(nnx.state(abstract)) == jax.tree.structure(state)


def test_report_str():
  r = aqtr.flax.common.Report(100, 30, 40)
  assert r.kernel_ratio == pytest.approx(0.3)
  assert '100 B float -> 30 B frozen (0.300x)' in str(r)
  assert np.isfinite(aqtr.flax.common.Report(0, 0, 0).kernel_ratio)
