"""ema_stats and mean_absmax equal their hand-computed recurrences."""

import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.calibrations import EmaStats, MeanAbsMax

STEPS = [
  [1.0, -2.0, 0.0, 4.0],
  [0.0, 0.0, 3.0, -1.0],
  [0.0, 0.0, 0.0, 0.0],
  [2.0, 2.0, -2.0, 2.0],
  [8.0, 0.0, 0.0, 0.0],
]


def _run(c, steps):
  st = c.init_state(jnp.zeros((1, 1, 1, 4)), (3,), None)
  bounds = []
  for row in steps:
    b, st = c.bound_with_state(jnp.array([[[row]]]), (3,), None, st)
    bounds.append(float(b.squeeze()))
  return bounds, st


def _reference(c, steps):
  """The recurrence written out in plain Python."""
  n, s = c.prior_count, {'l1': c.prior_l1, 'lp': c.prior_lp, 'max': c.prior_max}
  out = []
  for t, row in enumerate(steps):
    a = np.abs(np.asarray(row))
    kept = a[a != 0] if c.exclude_zeros else a
    frozen = c.freeze_step is not None and t >= c.freeze_step
    if len(kept) and not frozen:
      n = min(n + 1, c.ema_update_count)
      batch = {'l1': kept.mean(), 'lp': (kept**c.p).mean(), 'max': a.max()}
      s = {k: s[k] + (batch[k] - s[k]) / n for k in s}
    out.append(
      c.c1 * s['l1'] + c.c2 * s['lp'] ** (1 / c.p) + c.c3 * s['max'] + c.c0
    )
  return out


def test_ema_stats_recurrence_with_priors_zeros_and_freeze():
  for c in (
    EmaStats(c1=1.0, c2=0.5, c3=0.25, c0=0.1, ema_update_count=2),
    EmaStats(
      c1=2.0,
      c2=1.0,
      c3=0.5,
      p=3.0,
      ema_update_count=3,
      prior_count=2.0,
      prior_l1=1.0,
      prior_lp=8.0,
      prior_max=5.0,
      exclude_zeros=True,
    ),
    EmaStats(c1=0.0, c3=1.0, exclude_zeros=True, freeze_step=2),
  ):
    got, _ = _run(c, STEPS)
    np.testing.assert_allclose(got, _reference(c, STEPS), rtol=1e-5)


def test_mean_absmax_is_the_mean_of_step_maxima():
  got, st = _run(MeanAbsMax(), STEPS)
  maxima = [max(abs(v) for v in row) for row in STEPS]
  want = np.cumsum(maxima) / np.arange(1, len(STEPS) + 1)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert float(st['stats']['count'].squeeze()) == len(STEPS)


def test_ema_stats_per_example_weights_leave_padding_out():
  c = EmaStats(c1=1.0, c3=1.0, example_weights=True, ema_update_count=4)
  x = jnp.array([[[[1.0, -2.0], [100.0, 100.0], [3.0, 0.0]]]])  # 3 rows
  axes = (0, 1, 2, 3)  # per tensor
  st = c.init_state(x, axes, None)
  assert st['stats']['weights'].shape == (1, 1, 3, 1)
  st['stats']['weights'] = jnp.array([1.0, 0.0, 2.0]).reshape(1, 1, 3, 1)
  b, new = c.bound_with_state(x, axes, None, st)
  # Row 1 (weight 0) is out; row 2 counts twice.
  l1 = (1.0 + 2.0 + 2 * (3.0 + 0.0)) / (1 + 1 + 2 + 2)
  np.testing.assert_allclose(float(b.squeeze()), l1 + 3.0, rtol=1e-6)
  np.testing.assert_array_equal(new['stats']['weights'], st['stats']['weights'])


def test_with_example_weights_reshapes_and_checks():
  cfg = aqtr.presets.int8()
  lhs = aqtr.TensorConfig(
    calibration=EmaStats(example_weights=True),
    tiling=aqtr.tilings.PerTensor(),
  )
  cfg = aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=lhs, rhs=cfg.fwd.rhs),
    dlhs=cfg.dlhs,
    drhs=cfg.drhs,
  )
  dn = (((2,), (0,)), ((), ()))
  x, w = jnp.ones((2, 3, 8)), jnp.ones((8, 4))
  s = aqtr.state.init(x, w, dn, cfg)
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  s = aqtr.state.with_example_weights(s, 'fwd.lhs', mask)
  x = x.at[0, 2].set(50.0).at[1, 1:].set(50.0)  # padding rows
  _, new = aqtr.dot_general(x, w, dn, cfg, state=s)
  np.testing.assert_allclose(new['fwd.lhs']['stats']['l1'].squeeze(), 1.0)
  with pytest.raises(ValueError, match=r'fwd\.lhs: .* 6 rows'):
    aqtr.state.with_example_weights(s, 'fwd.lhs', jnp.ones(5))


def test_ema_stats_rejects_all_zero_coefficients():
  with pytest.raises(ValueError, match=r'EmaStats\.c0, c1, c2, c3 are all 0'):
    EmaStats(c1=0.0)
  EmaStats(c1=0.0, c0=0.5)  # any one > 0 will do


@pytest.mark.parametrize(
  'cal', [EmaStats(c1=1.0, c3=1.0), MeanAbsMax()], ids=['ema', 'mean_absmax']
)
@pytest.mark.parametrize('bad', [jnp.nan, jnp.inf])
def test_a_non_finite_step_is_nan_but_leaves_the_statistics(cal, bad):
  # Was: the NaN/inf entered the running statistics, NaN forever after.
  clean, _ = _run(cal, [STEPS[0], STEPS[3]])
  st = cal.init_state(jnp.zeros((1, 1, 1, 4)), (3,), None)
  _, st = cal.bound_with_state(jnp.array([[[STEPS[0]]]]), (3,), None, st)
  row = jnp.array([[[[bad, 1.0, 2.0, 3.0]]]])
  b, st = cal.bound_with_state(row, (3,), None, st)
  assert bool(jnp.isnan(b.squeeze()))
  b, st = cal.bound_with_state(jnp.array([[[STEPS[3]]]]), (3,), None, st)
  if isinstance(cal, MeanAbsMax):  # the bad step is not counted at all
    assert float(b.squeeze()) == clean[-1]
  else:  # its finite values are a batch of their own
    assert np.isfinite(float(b.squeeze()))
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in st['stats'].values())
