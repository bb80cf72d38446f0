"""Tests of the 'calibration' freezer: static ranges through every mode.

Framework-free, through `aqtr.freezers.lifecycle` (the Flax adapters store
what it returns; tests/flax checks the storage).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations
from aqtr.freezers import CalibrationFreezer, Mode, lifecycle

DN = (((1,), (0,)), ((), ()))


def _data(seed, shape, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _cfg(per_channel=False, side='lhs'):
  f = CalibrationFreezer(per_channel=per_channel)
  return aqtr.freezers.configure(aqtr.presets.int8(), **{side: f})


def _calibrate(cfg, xs, w):
  stats = None
  for x in xs:
    r = lifecycle.run(
      lifecycle.DotCall(x, w, DN, cfg), Mode.CALIBRATE, stats=stats
    )
    stats = r.stats
  return stats


def test_statistic_and_running_mean():
  f = CalibrationFreezer()
  x3 = _data(0, (2, 3, 4))
  b = f.statistic(x3, calibrations.AbsMax(clip_scale=0.5))
  assert b.shape == () and float(b) == pytest.approx(
    0.5 * float(jnp.abs(x3).max())
  )
  pc = CalibrationFreezer(per_channel=True).statistic(x3, calibrations.AbsMax())
  np.testing.assert_array_equal(pc, jnp.abs(x3).max(axis=(0, 2)))
  s = f.init_stats(())
  for v in (1.0, 2.0, 6.0):
    s = f.update_stats(s, jnp.float32(v))
  assert int(s['count']) == 3 and float(s['mean']) == pytest.approx(3.0)
  assert f.frozen(s) == {'bound': s['mean']}
  assert f.stores(Mode.CONVERT) == ('bound',) and f.collects


def test_calibrate_counts_steps_and_averages_absmax():
  cfg = _cfg()
  w = _data(1, (16, 4))
  xs = [_data(10 + i, (8, 16), scale=1.0 + i) for i in range(3)]
  stats = _calibrate(cfg, xs, w)
  assert set(stats) == {'lhs'}
  assert int(stats['lhs']['count']) == 3
  want = np.mean([float(jnp.abs(x).max()) for x in xs])
  assert float(stats['lhs']['mean']) == pytest.approx(want, rel=1e-6)
  # The CALIBRATE output is the dynamic (TRAIN) one.
  r = lifecycle.run(
    lifecycle.DotCall(xs[0], w, DN, cfg), Mode.CALIBRATE, stats=stats
  )
  np.testing.assert_array_equal(
    r.out, lifecycle.run(lifecycle.DotCall(xs[0], w, DN, cfg), Mode.TRAIN).out
  )


def test_train_and_serve_do_not_touch_statistics():
  cfg = _cfg()
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  assert (
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.TRAIN).stats is None
  )
  stats = _calibrate(cfg, [x], w)
  conv = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT, stats=stats
  )
  served = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen=conv.frozen
  )
  assert served.stats is None and served.frozen is None


def test_serve_uses_the_frozen_bound_without_recomputing_it():
  cfg = _cfg()
  w = _data(1, (16, 4))
  xs = [_data(10 + i, (8, 16)) for i in range(2)]
  stats = _calibrate(cfg, xs, w)
  frozen = lifecycle.run(
    lifecycle.DotCall(xs[0], w, DN, cfg), Mode.CONVERT, stats=stats
  ).frozen
  b = frozen['lhs']['bound']
  assert float(b) == float(stats['lhs']['mean'])

  def serve(x, fr=frozen):
    return lifecycle.run(
      lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen=fr
    ).out

  # In range: close to float.
  x = xs[0]
  np.testing.assert_allclose(serve(x), x @ w, rtol=0.05, atol=0.05)
  # Out of range: clipped at the frozen bound (a dynamic range would not).
  big = 10 * x
  np.testing.assert_array_equal(serve(big), serve(jnp.clip(big, -b, b)))
  dynamic = lifecycle.run(lifecycle.DotCall(big, w, DN, cfg), Mode.TRAIN).out
  assert not np.allclose(serve(big), dynamic, rtol=0.05)
  # The value used is the frozen one.
  doubled = {'lhs': {'bound': 2 * b}}
  assert not np.array_equal(serve(x, doubled), serve(x))
  # CONVERT returns the SERVE output.
  np.testing.assert_array_equal(
    lifecycle.run(
      lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT, stats=stats
    ).out,
    serve(x),
  )


def test_static_range_equals_b_times_unit_range_dot():
  """SERVE = b * dot(x / b, w) with a Constant(1) lhs calibration."""
  cfg = _cfg()
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  b = jnp.float32(1.7)
  got = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen={'lhs': {'bound': b}}
  )
  lhs = dataclasses.replace(
    cfg.fwd.lhs, calibration=calibrations.Constant(bound=1.0)
  )
  unit = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, lhs=lhs))
  want = b * aqtr.dot_general(x / b, w, DN, unit)
  np.testing.assert_array_equal(got.out, want)


def test_static_range_gradients_are_straight_through():
  cfg = _cfg()
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  frozen = {'lhs': {'bound': 1.5 * jnp.abs(x).max()}}

  def loss(x, w):
    out = lifecycle.run(
      lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen=frozen
    ).out
    return jnp.sum(out**2)

  gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  fx, fw = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), (0, 1))(x, w)
  for a, b in ((gx, fx), (gw, fw)):
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert 0 < rel < 0.05


def test_per_channel_weights_bound():
  cfg = _cfg(per_channel=True, side='rhs')
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  stats = _calibrate(cfg, [x, x], w)
  np.testing.assert_allclose(stats['rhs']['mean'], jnp.abs(w).max(axis=0))
  frozen = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT, stats=stats
  ).frozen
  assert frozen['rhs']['bound'].shape == (4,)
  served = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen=frozen
  ).out
  train = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.TRAIN).out
  np.testing.assert_allclose(served, train, rtol=1e-5, atol=1e-5)


def test_convert_without_statistics_says_calibrate_first():
  cfg = _cfg()
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  with pytest.raises(ValueError, match='CALIBRATE'):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT)
  empty = {'lhs': CalibrationFreezer().init_stats(())}
  with pytest.raises(ValueError, match='CALIBRATE'):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT, stats=empty)


def test_frozen_bound_of_the_wrong_shape_is_reported():
  cfg = _cfg()
  x, w = _data(0, (8, 16)), _data(1, (16, 4))
  with pytest.raises(ValueError, match='bound has shape'):
    lifecycle.run(
      lifecycle.DotCall(x, w, DN, cfg),
      Mode.SERVE,
      frozen={'lhs': {'bound': jnp.ones(8)}},
    )
  with pytest.raises(ValueError, match='lacks the lhs'):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen={})


def test_zero_bound_is_safe():
  cfg = _cfg()
  x, w = jnp.zeros((8, 16)), _data(1, (16, 4))
  out = lifecycle.run(
    lifecycle.DotCall(x, w, DN, cfg),
    Mode.SERVE,
    frozen={'lhs': {'bound': jnp.float32(0)}},
  ).out
  np.testing.assert_array_equal(out, jnp.zeros((8, 4)))


def test_a_non_finite_calibrate_batch_is_left_out():
  # It used to make the mean NaN, which SERVE then replaced by a bound of 1.
  cfg = _cfg()
  w = _data(1, (16, 4))
  xs = [_data(10 + i, (8, 16), scale=1.0 + i) for i in range(3)]
  bad = xs[1].at[2, 3].set(jnp.nan)
  stats = _calibrate(cfg, [xs[0], bad, xs[2]], w)
  assert int(stats['lhs']['count']) == 2
  want = np.mean([float(jnp.abs(x).max()) for x in (xs[0], xs[2])])
  assert float(stats['lhs']['mean']) == pytest.approx(want, rel=1e-6)
  # A NaN bound given to SERVE propagates instead of becoming 1.
  frozen = {'lhs': {'bound': jnp.float32(jnp.nan)}}
  call = lifecycle.DotCall(xs[0], w, DN, cfg)
  out = lifecycle.run(call, Mode.SERVE, frozen=frozen).out
  assert bool(jnp.all(jnp.isnan(out)))


def test_affine_numerics_are_refused_naming_the_freezer():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int4_asym_weight_only(8), rhs=CalibrationFreezer()
  )
  x, w = _data(0, (4, 16)), _data(1, (16, 4))
  with pytest.raises(
    ValueError, match=r'fwd\.rhs\.freezer is Calibration.*affine'
  ):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.CALIBRATE)
