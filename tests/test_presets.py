"""Tests for aqtr.presets: explicit, hashable trees that mean what they say."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics, presets, tilings
from aqtr.core.lowering import is_dot, sub_jaxprs

NAMES = sorted(presets.__all__)
PASSES = ('fwd', 'dlhs', 'drhs')


def _walk(node, path='cfg'):
  """(path, value) of every dataclass field in the tree, recursively."""
  for f in dataclasses.fields(node):
    value = getattr(node, f.name)
    yield f'{path}.{f.name}', value
    if dataclasses.is_dataclass(value):
      yield from _walk(value, f'{path}.{f.name}')


def _int_bits(t: aqtr.TensorConfig):
  n = t.numerics
  return n.bits if isinstance(n, numerics.IntSymmetric) else None


@pytest.mark.parametrize('name', NAMES)
def test_presets_are_explicit_hashable_trees(name):
  cfg = getattr(presets, name)()
  assert isinstance(cfg, aqtr.DotGeneralConfig)
  leaves = list(_walk(cfg))
  nones = [path for path, value in leaves if value is None]
  assert not nones, f'{name}: None at {nones}'
  for path, value in leaves:
    if path.count('.') == 3 and not isinstance(value, bool):
      # cfg.<pass>.<side>.<algorithm> (bool fields are switches).
      assert dataclasses.is_dataclass(value), path
  assert hash(cfg) == hash(getattr(presets, name)())
  assert cfg == getattr(presets, name)()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.fwd = cfg.dlhs


def test_presets_are_all_different():
  cfgs = [getattr(presets, n)() for n in NAMES if n != 'fully_quantized']
  assert len(set(cfgs)) == len(cfgs)
  assert presets.fully_quantized() == presets.int8()


def test_float():
  cfg = presets.float()
  assert cfg.is_float
  for p in PASSES:
    raw = getattr(cfg, p)
    assert not raw.lhs.quantized and not raw.rhs.quantized


def test_int8():
  cfg = presets.int8()
  for p in PASSES:
    raw = getattr(cfg, p)
    assert _int_bits(raw.lhs) == 8
    assert raw.lhs.tiling == tilings.PerChannel()
    assert isinstance(raw.lhs.calibration, calibrations.AbsMax)
    assert raw.lhs.rounding == aqtr.NearestEven()
  assert _int_bits(cfg.fwd.rhs) == 8
  assert cfg.dlhs.use_fwd_quant and cfg.drhs.use_fwd_quant


def test_int8_fwd_has_float_backward():
  cfg = presets.int8_fwd()
  assert _int_bits(cfg.fwd.lhs) == _int_bits(cfg.fwd.rhs) == 8
  assert not cfg.dlhs.quantized and not cfg.drhs.quantized
  assert cfg == presets.fully_quantized(8, None)


def test_fully_quantized_bits_and_stochastic_rounding():
  cfg = presets.fully_quantized(fwd_bits=4, bwd_bits=6)
  assert _int_bits(cfg.fwd.lhs) == _int_bits(cfg.fwd.rhs) == 4
  assert _int_bits(cfg.dlhs.lhs) == _int_bits(cfg.drhs.lhs) == 6
  sr = presets.fully_quantized(8, 8, stochastic_rounding=True)
  # stochastic rounding on the gradient operand only, as in AQT
  assert sr.dlhs.lhs.rounding.stochastic and sr.drhs.lhs.rounding.stochastic
  assert not sr.fwd.lhs.rounding.stochastic
  assert not sr.fwd.rhs.rounding.stochastic
  # the residual reuses the forward quantization: no second rounding
  assert sr.dlhs.use_fwd_quant and sr.drhs.use_fwd_quant
  # and the bound maps inside the clip range (unbiased top bucket)
  assert sr.dlhs.lhs.numerics.preserve_max_val


def test_fully_quantized_float_forward():
  cfg = presets.fully_quantized(fwd_bits=None, bwd_bits=8)
  assert not cfg.fwd.lhs.quantized and not cfg.fwd.rhs.quantized
  assert cfg.dlhs.lhs.quantized


@pytest.mark.parametrize(
  'kwargs',
  [
    dict(fwd_bits=0),
    dict(fwd_bits=9),
    dict(bwd_bits=0),
    dict(bwd_bits=16),
  ],
)
def test_bits_out_of_range_raise(kwargs):
  with pytest.raises(
    ValueError, match=r'_bits must be None or an int in 1\.\.8'
  ):
    presets.fully_quantized(**kwargs)


@pytest.mark.parametrize(
  'name, kwargs, arg',
  [
    ('int4_asym_weight_only', dict(group=0), 'group'),  # used 128 silently
    ('int4_asym_weight_only', dict(group=32.0), 'group'),
    ('int4_asym_weight_only', dict(group=True), 'group'),
    ('fp8_delayed', dict(history_length=0), 'history_length'),
    ('fully_quantized', dict(fwd_bits=8.0), 'fwd_bits'),
    ('fully_quantized', dict(bwd_bits=True), 'bwd_bits'),
    ('fully_quantized', dict(stochastic_rounding='no'), 'stochastic_rounding'),
    ('int8_sparse_2_4', dict(start_step=-1), 'start_step'),
    ('int8_sparse_2_4', dict(update_step=0), 'update_step'),
    ('fp8_full', dict(constant_bounds=(1.0,) * 5), 'constant_bounds'),
    ('fp8_full', dict(constant_bounds=(0.0,) * 6), 'constant_bounds'),
    ('fp8_full', dict(constant_bounds=(True,) * 6), 'constant_bounds'),
  ],
)
def test_bad_preset_arguments_name_the_argument(name, kwargs, arg):
  with pytest.raises((TypeError, ValueError), match=rf'{name}: {arg} must be'):
    getattr(presets, name)(**kwargs)


def test_stochastic_rounding_needs_backward_bits():
  with pytest.raises(ValueError, match='bwd_bits'):
    presets.fully_quantized(8, None, stochastic_rounding=True)


@pytest.mark.parametrize(
  'name,bits,dtype',
  [('int8_weight_only', 8, jnp.int8), ('int4_weight_only', 4, jnp.int4)],
)
def test_weight_only(name, bits, dtype):
  cfg = getattr(presets, name)()
  assert not cfg.fwd.lhs.quantized
  assert _int_bits(cfg.fwd.rhs) == bits
  assert cfg.fwd.rhs.numerics.dtype == dtype
  assert not cfg.dlhs.quantized and not cfg.drhs.quantized


def test_w4a8_is_int4_weights_times_int8_rows_and_reuses_them_backward():
  cfg = presets.w4a8()
  assert _int_bits(cfg.fwd.lhs) == 8 and _int_bits(cfg.fwd.rhs) == 4
  assert cfg.fwd.rhs.numerics.dtype == jnp.int4
  assert cfg.fwd.rhs == presets.int4_weight_only().fwd.rhs
  assert cfg.dlhs.use_fwd_quant and cfg.drhs.use_fwd_quant
  assert not cfg.dlhs.lhs.quantized and not cfg.drhs.lhs.quantized
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  y, vjp = jax.vjp(lambda x, w: aqtr.dot_general(x, w, dn, cfg), x, w)
  dx, dw = vjp(g)
  sx = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127
  sw = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 7
  xq, wq = jnp.round(x / sx) * sx, jnp.round(w / sw) * sw
  np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, g @ wq.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, xq.T @ g, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(dw - x.T @ g).max()) > 1e-3  # x's int8 is reused


def test_fp8():
  cfg = presets.fp8()
  e4, e5 = 'float8_e4m3fn', 'float8_e5m2'
  assert cfg.fwd.lhs.numerics.dtype_name == e4
  assert cfg.fwd.rhs.numerics.dtype_name == e4
  assert cfg.dlhs.lhs.numerics.dtype_name == e5
  assert cfg.drhs.lhs.numerics.dtype_name == e5


# Presets whose weights (or both operands) have 4 bits: looser error bound.
FOUR_BITS = (
  'int4_weight_only',
  'int4_asym_weight_only',
  'mxfp4_weight_only',
  'nvfp4',
  'nvfp4_weight_only',
  'w4a8',
)


# Both operands in 4 bits, at the calibration's initial state (LSQ's
# 2 mean|x| / sqrt(7) step: measured 0.246).
BOTH_FOUR_BITS = ('int4_lsq', 'mxfp4_training', 'nvfp4_training')


def test_every_preset_runs_forward_and_backward():
  # Every contraction (128, and 32 for the backward passes) is a multiple of
  # the block formats' blocks (16, 32) and int4_asym_weight_only's group.
  x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 128)))
  w = jnp.asarray(np.random.default_rng(1).standard_normal((128, 32)))
  dn = (((1,), (0,)), ((), ()))
  cfgs = {n: getattr(presets, n)() for n in NAMES}
  cfgs['sr'] = presets.fully_quantized(8, 8, stochastic_rounding=True)
  cfgs['deepseek_v3_fp8'] = presets.deepseek_v3_fp8(tile=32)  # 128 > 32

  @jax.jit
  def run(x, w):
    out = {}
    for name, cfg in cfgs.items():

      def loss(x, w, cfg=cfg):
        s = aqtr.state.init(x, w, dn, cfg) or None  # fp8_delayed
        y = aqtr.dot_general(x, w, dn, cfg, key=jax.random.key(0), state=s)
        y = y if s is None else y[0]
        return jnp.sum(y * y), y

      (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
      out[name] = (y, *grads)
    return out

  ref = np.asarray(x) @ np.asarray(w)
  w24 = np.asarray(aqtr.sparsity.NM().mask(w[None], 1)[0]) * np.asarray(w)
  for name, (y, dx, dw) in run(x, w).items():
    assert y.shape == (32, 32) and dx.shape == x.shape and dw.shape == w.shape
    for a in (y, dx, dw):
      assert np.isfinite(np.asarray(a)).all(), name
    ref = np.asarray(x) @ (w24 if name == 'int8_sparse_2_4' else np.asarray(w))
    err = np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref)
    bound = (
      0.3 if name in BOTH_FOUR_BITS else 0.2 if name in FOUR_BITS else 0.07
    )
    assert err < bound, (name, err)


# The dots (lhs dtype, rhs dtype) -> count in the jaxpr of fwd + grad.
F32, I8 = 'float32', 'int8'
E4, E5 = 'float8_e4m3fn', 'float8_e5m2'
E4Z, E5Z = 'float8_e4m3fnuz', 'float8_e5m2fnuz'
DOTS = {
  'switchback': {(I8, I8): 2, (F32, F32): 1},
  'aqt_v4': {(I8, I8): 2, (F32, F32): 1},
  'fp8_nanoo': {(E4Z, E4Z): 1, (E5Z, E4Z): 1, (E4Z, E5Z): 1},
  # Both backward operands requantized to e5m2 (no forward reuse).
  'fp8_full': {(E4, E4): 1, (E5, E5): 2},
  # A contraction over several MX / NVFP4 blocks (K = 128: 4 blocks of 32,
  # 8 of 16) is one f32 dot of the dequantized operands (XLA:CPU emulates
  # fp8 dots; `passes.dense_tiles`); the backward passes here contract 32
  # (one block): fp8 dots.
  'mxfp8': {(F32, F32): 1, (E5, E4): 1, (E4, E5): 1},
  # Weight-only: float activations, so float dots (the weights pass through
  # their stored dtype).
  'mxfp4_weight_only': {(F32, F32): 3},
  'int4_asym_weight_only': {(F32, F32): 3},
  # fp4 values are stored in float8_e4m3fn.
  'nvfp4': {(F32, F32): 3},
  # + the f32 n x n products of the RHT ('matmul'), one per rotated operand.
  'nvfp4_training': {(F32, F32): 5},
  # NVFP4 weights (stored in float8_e4m3fn), float activations.
  'nvfp4_weight_only': {(F32, F32): 3},
  # RHT-32 on both operands of all three passes (Quartet's forward too).
  'mxfp4_training': {(E4, E4): 2, (F32, F32): 7},
}


def _dot_dtypes(jaxpr) -> dict:
  """Counts dot_general eqns by (lhs dtype, rhs dtype), recursively."""
  found = {}
  for eqn in jaxpr.eqns:
    if is_dot(eqn):
      key = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
      found[key] = found.get(key, 0) + 1
    for sub in sub_jaxprs(eqn):
      for k, n in _dot_dtypes(sub).items():
        found[k] = found.get(k, 0) + n
  return found


@pytest.mark.parametrize('name', sorted(DOTS))
def test_catalogue_presets_run_the_expected_dots(name):
  cfg = getattr(presets, name)()
  dn = (((1,), (0,)), ((), ()))

  def loss(x, w):
    return aqtr.dot_general(x, w, dn, cfg, key=jax.random.key(0)).sum()

  f = jax.value_and_grad(loss, (0, 1))
  jaxpr = jax.make_jaxpr(f)(jnp.ones((32, 128)), jnp.ones((128, 32)))
  assert _dot_dtypes(jaxpr.jaxpr) == DOTS[name]
  stored = {
    'mxfp4_weight_only': E4,
    'nvfp4_weight_only': E4,
    'int4_asym_weight_only': 'uint8',
  }.get(name)
  if stored:
    assert stored in str(jaxpr)


def test_catalogue_presets_mean_what_they_say():
  sb = presets.switchback()
  assert sb.fwd.lhs.tiling == tilings.PerChannel()
  assert sb.fwd.rhs.tiling == tilings.PerTensor()
  assert sb.dlhs.use_fwd_quant and not sb.drhs.quantized
  v4 = presets.aqt_v4()
  assert v4.dlhs.lhs.rounding.stochastic and not v4.dlhs.use_fwd_quant
  assert not v4.drhs.quantized and not v4.fwd.lhs.rounding.stochastic
  assert presets.fp8_nanoo().fwd.lhs.numerics.max_value == 240.0
  blocks = [('mxfp8', 32), ('mxfp4_weight_only', 32), ('nvfp4', 16)]
  for name, block in blocks + [('nvfp4_weight_only', 16)]:
    assert getattr(presets, name)().fwd.rhs.tiling.tile_size == block
  nv = presets.nvfp4_weight_only()
  assert nv.fwd.rhs == nv.dlhs.rhs == presets.nvfp4().fwd.rhs
  assert not nv.drhs.quantized
  assert not (nv.fwd.lhs.quantized or nv.dlhs.lhs.quantized)
  w4 = presets.int4_asym_weight_only(group=64).fwd.rhs
  assert w4.numerics == numerics.IntAsymmetric(bits=4, storage='uint8')
  assert w4.calibration == calibrations.MinMax()
  assert w4.tiling == tilings.SubChannel(tile_size=64)
  assert not presets.int4_asym_weight_only().fwd.lhs.quantized


def test_fp8_full_static_bounds_set_per_tensor_scales():
  dyn = presets.fp8_full()
  for p in PASSES:
    for side in ('lhs', 'rhs'):
      t = getattr(getattr(dyn, p), side)
      assert t.tiling == tilings.PerTensor()
      assert t.calibration == calibrations.AbsMax()
    assert not getattr(dyn, p).use_fwd_quant
  bounds = (2.0, 0.5, 3.0, 4.0, 5.0, 6)
  cfg = presets.fp8_full(constant_bounds=bounds)
  sides = [(p, s) for p in PASSES for s in ('lhs', 'rhs')]
  for (p, side), b in zip(sides, bounds, strict=True):
    t = getattr(getattr(cfg, p), side)
    assert t.calibration == calibrations.Constant(bound=float(b))
    x = jnp.arange(24.0).reshape(4, 6) - 9.0  # absmax 14, not the bound
    q = aqtr.quantize(x, t, contracting_axes=(1,))
    scale = np.asarray(q.scale).ravel()  # one value, held per row
    np.testing.assert_allclose(scale, b / t.numerics.max_value, rtol=1e-6)
  # Half static: only the forward weight keeps a fixed range.
  half = presets.fp8_full(constant_bounds=(None, 1.0, None, None, None, None))
  assert half.fwd.rhs.calibration == calibrations.Constant(bound=1.0)
  assert half.fwd.lhs.calibration == calibrations.AbsMax()
  dn = (((1,), (0,)), ((), ()))
  x, w = jnp.full((4, 8), 3.0), jnp.full((8, 2), 3.0)
  y = aqtr.dot_general(x, w, dn, half)
  np.testing.assert_allclose(np.asarray(y), 8 * 3.0 * 1.0, rtol=1e-5)  # w: 1
