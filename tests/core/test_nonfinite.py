"""NaN and inf through the quantized dot (aqtr/core/quantizer.py, scale.py).

The documented behaviour: every output (forward, dlhs, drhs) that
`lax.dot_general` makes non-finite is non-finite; in the forward pass the
other outputs stay finite, for every numerics and tiling (per-tensor
included: an inf marks its row, not the whole tile); an all-NaN group does
not quantize to zeros. Backward passes that reuse the forward quantization
spread a NaN row scale over their whole output (never less than lax).
The numerics and tilings are taken from the registries, so a newly
registered one is covered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import calibrations, numerics, presets, tilings
from aqtr.core.quantizer import quantize_view
from aqtr.core.scale import scale_from_bound

MK_KN = (((1,), (0,)), ((), ()))
NAN, INF = np.nan, np.inf

# Variants of the registered numerics to cover (default instance otherwise).
_NUMERICS_VARIANTS = {
  'int_symmetric': [numerics.IntSymmetric(bits=b) for b in range(2, 9)]
  + [numerics.IntSymmetric(bits=1, preserve_zero=False)],
  'fp8': [
    numerics.Fp8(dtype_name='float8_e4m3fn'),
    numerics.Fp8(dtype_name='float8_e5m2'),
  ],
}
# Tiling instances to cover; sub-channel with several tiles of every dot.
_TILING_VARIANTS = {
  'subchannel': [tilings.SubChannel(tile_size=8)],
  'block2d': [tilings.Block2d(tile_size=8, free_size=4)],
}


def _all(variants, registry):
  out = []
  for name in registry.names():
    out += variants.get(name, [registry.get(name)()])
  return out


NUMERICS = _all(_NUMERICS_VARIANTS, numerics)
TILINGS = _all(_TILING_VARIANTS, tilings)
# The default suite: the extremes of int_symmetric (the others: slow test).
_FAST = {
  'int_symmetric': [
    numerics.IntSymmetric(bits=8),
    numerics.IntSymmetric(bits=2),
    numerics.IntSymmetric(bits=1, preserve_zero=False),
  ]
}
NUMERICS_FAST = _all({**_NUMERICS_VARIANTS, **_FAST}, numerics)


def _id(x):
  fields = ','.join(
    f'{f.name}={getattr(x, f.name)}' for f in dataclasses.fields(x)
  )
  return f'{type(x).__name__}({fields})'


def _config(num, tiling):
  """Every operand of every pass quantized with (num, tiling); dlhs reuses
  the forward quantization, drhs quantizes the float residual again."""
  # Affine numerics calibrate a range; block formats tile in their blocks.
  # (The backward contractions of block formats are int8: too short.)
  cal = calibrations.MinMax() if num.asymmetric else calibrations.AbsMax()
  g = aqtr.TensorConfig(tiling=tiling)
  block = num.quantizes and num.block_size is not None
  if block:
    tiling = tilings.SubChannel(tile_size=num.block_size)
  t = aqtr.TensorConfig(numerics=num, calibration=cal, tiling=tiling)
  r = g if block else t
  # Numerics not meant for gradients (e.g. nf4): int8 gradient operands.
  g = t if num.for_gradients and not block else g
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t),
    dlhs=aqtr.DotGeneralRaw(lhs=g, rhs=t, use_fwd_quant=True),
    drhs=aqtr.DotGeneralRaw(lhs=g, rhs=r, use_fwd_quant=False),
  )


def _vjp(fn):
  """(out, dlhs, drhs) of `fn` for a cotangent g, jitted."""

  @jax.jit
  def run(x, w, g):
    out, pull = jax.vjp(fn, x, w)
    return (out, *pull(g))

  return run


_LAX = _vjp(lambda x, w: lax.dot_general(x, w, MK_KN))


def _engine(num, tiling):
  cfg = _config(num, tiling)
  return _vjp(lambda a, b: aqtr.dot_general(a, b, MK_KN, cfg))


def _operands():
  """x [8, 32], w [32, 16], g [8, 16] with NaN / inf in a few places."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 32)).astype(np.float32)
  w = rng.standard_normal((32, 16)).astype(np.float32)
  g = rng.standard_normal((8, 16)).astype(np.float32)
  x[1, 5], x[2, 30] = NAN, INF
  w[7, 3], w[20, 9] = -INF, NAN
  g[3, 0] = NAN
  return x, w, g


def _check(got, want, exact_fwd=True):
  names = ('out', 'dlhs', 'drhs')
  for name, a, b in zip(names, got, want, strict=True):
    bad = ~np.isfinite(np.asarray(b))
    assert bad.any() and not bad.all(), name  # the case is not trivial
    a = np.asarray(a)
    assert not np.isfinite(a[bad]).any(), f'{name}: lax non-finite, ours not'
    if name == 'out' and exact_fwd:
      assert np.isfinite(a[~bad]).all(), 'out: lax finite, ours not'


@pytest.mark.parametrize('num', NUMERICS_FAST, ids=_id)
def test_every_numerics_propagates_nan_and_inf(num):
  x, w, g = _operands()
  # Per-tensor: the tiling whose groups span rows.
  _check(_engine(num, tilings.PerTensor())(x, w, g), _LAX(x, w, g))


@pytest.mark.parametrize('tiling', TILINGS, ids=_id)
def test_every_tiling_propagates_nan_and_inf(tiling):
  x, w, g = _operands()
  run = _engine(numerics.IntSymmetric(bits=8), tiling)
  _check(run(x, w, g), _LAX(x, w, g))
  # Only g non-finite: the reused forward scales are finite, and the
  # gradients are non-finite exactly where lax's are.
  xf, wf = (np.nan_to_num(a, nan=0.5, posinf=1.0, neginf=-1.0) for a in (x, w))
  got, want = run(xf, wf, g), _LAX(xf, wf, g)
  for a, b in zip(got[1:], want[1:], strict=True):
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))


@pytest.mark.slow
@pytest.mark.parametrize('tiling', TILINGS, ids=_id)
@pytest.mark.parametrize('num', NUMERICS, ids=_id)
def test_every_numerics_and_tiling_propagate_nan_and_inf(num, tiling):
  x, w, g = _operands()
  _check(_engine(num, tiling)(x, w, g), _LAX(x, w, g))


@pytest.mark.parametrize('preset', ['int8', 'fp8', 'int4_weight_only'])
def test_issue_example_nan_in_a_weight(preset):
  key_x, key_w = jax.random.split(jax.random.key(0))
  x = jax.random.normal(key_x, (16, 32))
  w = jax.random.normal(key_w, (32, 128)).at[1, 1].set(jnp.nan)
  cfg = getattr(presets, preset)()
  run = jax.jit(lambda x, w: aqtr.dot_general(x, w, MK_KN, cfg))
  got, want = run(x, w), lax.dot_general(x, w, MK_KN)
  assert int(jnp.isnan(want).sum()) == 16
  np.testing.assert_array_equal(jnp.isnan(got), jnp.isnan(want))
  # An all-NaN x: every output NaN (lax too), none finite.
  assert not jnp.isfinite(run(jnp.full_like(x, jnp.nan), w)).any()


def test_issue_example_all_nan_activations():
  # The shape where XLA:CPU's jitted max over NaNs returned -inf.
  x = jnp.full((64, 128), jnp.nan)
  w = jax.random.normal(jax.random.key(1), (128, 16))
  got = jax.jit(lambda x, w: aqtr.dot_general(x, w, MK_KN, presets.int8()))(
    x, w
  )
  assert not jnp.isfinite(got).any()


@pytest.mark.parametrize('tiling', TILINGS, ids=_id)
def test_an_all_nan_group_does_not_quantize_to_zeros(tiling):
  x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
  x[2] = NAN
  t = aqtr.TensorConfig(tiling=tiling)
  dq, fq = jax.jit(
    lambda x: (aqtr.quantize(x, t).dequant(), aqtr.fake_quant(x, t))
  )(x)
  assert np.isnan(dq[2]).all()
  assert np.isfinite(np.delete(dq, 2, axis=0)).all()
  np.testing.assert_array_equal(fq, dq)


def test_per_tensor_inf_marks_its_row_only():
  """Issue example: one inf under per-tensor tiling, lax: 16 infs."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((16, 32)).astype(np.float32)
  w = rng.standard_normal((32, 8)).astype(np.float32)
  x[4, 9] = INF
  t = aqtr.TensorConfig(tiling=tilings.PerTensor())
  cfg = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))
  run = jax.jit(lambda x, w: aqtr.dot_general(x, w, MK_KN, cfg))
  got = np.asarray(run(x, w))
  want = np.asarray(lax.dot_general(x, w, MK_KN))
  assert (~np.isfinite(want)).sum() == 8
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  # The finite rows are quantized with the bound of the finite values.
  xf = x.copy()
  xf[4] = 0
  ref = np.asarray(run(xf, w))
  np.testing.assert_array_equal(np.delete(got, 4, 0), np.delete(ref, 4, 0))


def test_clip_gradient_does_not_zero_non_finite_values():
  num = numerics.IntSymmetric(bits=8, clip_gradient=True)
  t = aqtr.TensorConfig(numerics=num, tiling=tilings.PerTensor())
  x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)))
  x = x.astype(jnp.float32).at[1, 2].set(jnp.inf).at[2, 3].set(jnp.nan)
  g = jax.jit(jax.grad(lambda x: (aqtr.fake_quant(x, t) * 2.0).sum()))(x)
  assert g[1, 2] == 2.0 and g[2, 3] == 2.0


@pytest.mark.parametrize(
  'cal',
  [
    calibrations.AbsMax(),
    calibrations.AbsMax(clip_scale=0.5, po2_scale=True),
    calibrations.get('mse')(),
  ],
  ids=['absmax', 'absmax_clip_po2', 'mse'],
)
def test_per_tensor_guard_matches_the_masked_reference(cal):
  """Groups spanning rows: q and S bit for bit as the written-mask recipe
  (calibrate `where(isfinite(x), x, 0)`, NaN on each row with a NaN/inf)."""
  t = aqtr.TensorConfig(calibration=cal, tiling=tilings.PerTensor())
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 1, 6, 16)).astype(np.float32) * 3
  bad = x.copy()
  bad[0, 0, 1, 3], bad[0, 0, 4, 0], bad[1, 0, 2, 15] = NAN, INF, -INF
  bad[1, 0, 5] = NAN

  def reference(x):
    finite = jnp.isfinite(x)
    axes = (0, 1, 2, 3)
    b = cal.bound_for(jnp.where(finite, x, 0.0), axes, t.numerics)
    s = scale_from_bound(b, t.numerics, cal.po2_scale)
    flags = jnp.where(finite, 0.0, NAN).sum(axis=(1, 3), keepdims=True)
    s = jnp.broadcast_to(s + flags, (2, 1, 6, 1))
    return t.numerics.quantize(x / s), s

  for v in (x, bad):
    got = jax.jit(lambda v: quantize_view(v, t, 'fk')[:2])(v)
    want = jax.jit(reference)(v)
    for g, w in zip(got, want, strict=True):
      assert g.shape == w.shape and g.dtype == w.dtype
      assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
