"""Contract test of the `calibrations` registry (DESIGN.md section 4).

Every registered calibration is tested the moment it registers: it builds
from `fdl.Config` with its defaults; it is hashable, equal to a rebuilt one
and a static `jax.jit` argument; inside a TensorConfig, `aqtr.dot_general`
runs under jit with finite gradients and agrees with the fake-quant
reference (bit for bit with `po2_scale=True`), its VJP with autodiff of that
reference; the bound is >= 0 with the reduced axes kept; a NaN or inf in a
group makes that group's bound non-finite (and the dot's output there);
all-zero input quantizes without NaN (scale 1 where the bound is 0); bad
field values raise an error naming the field (BAD_FIELDS below).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import contract_checks as cc

import aqtr
from aqtr import calibrations

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# calibration needs an entry ([] only without fields beyond po2_scale).
BAD_FIELDS = {
  'absmax': [
    {'clip_scale': 0.0},
    {'clip_scale': -1.0},
    {'clip_scale': math.nan},
    {'clip_scale': math.inf},
    {'clip_scale': True},
    {'clip_scale': '1'},
  ],
  'delayed_scaling': [
    {'history_length': 0},
    {'history_length': 2.0},
    {'history_length': True},
  ],
  'lsq': [{'po2_scale': 1}],
  'ema_stats': [
    {'p': 0.0},
    {'c1': -1.0},
    {'c0': math.nan},
    {'ema_update_count': 0},
    {'prior_count': -1.0},
    {'exclude_zeros': 1},
    {'freeze_step': -1},
  ],
  'mean_absmax': [{'po2_scale': 'yes'}],
  'pact': [
    {'init_clip': 0.0},
    {'init_clip': math.nan},
    {'init_clip': '1'},
    {'l2': -1.0},
    {'l2': math.inf},
    {'l2': 'x'},
  ],
  'constant': [
    {'bound': 0.0},
    {'bound': -2.0},
    {'bound': math.inf},
    {'bound': math.nan},
    {'bound': False},
    {'bound': 'x'},
  ],
  'mse': [
    {'steps': 1},
    {'steps': 2.5},
    {'steps': True},
    {'rounds': 0},
    {'rounds': '2'},
  ],
  'percentile': [
    {'q': 0.0},
    {'q': 100.5},
    {'q': math.nan},
    {'q': '99'},
    {'q': True},
    {'method': 'quantile'},
    {'bins': 1},
    {'bins': 8.0},
  ],
  'rms': [
    {'p': 0.5},
    {'p': math.inf},
    {'p': True},
    {'c': 0.0},
    {'c': -1.0},
    {'c': math.nan},
    {'c': '3'},
  ],
}

# 4-D inputs (the quantizer's [batch, tile, free, k] view) and reductions.
_AXES = ((3,), (2, 3), (1, 3), (0, 1, 2, 3))


def _input(seed=0, shape=(2, 3, 4, 8)):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * 3.0, jnp.float32)


def _calibrate(c, x, axes):
  return jax.jit(c.calibrate, static_argnums=1)(x, axes)


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  c = cc.check_builds(cls, calibrations.Calibration)
  assert c.po2_scale is False


def check_static_arg(cls, bad_fields):
  """A static jit argument."""
  del bad_fields
  cc.check_static_arg(cls, lambda c, x: c.calibrate(x, (1,)), _input()[0, 0])


_DN = (((1,), (0,)), ((), ()))


def _stateful_cfg(c):
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(
      lhs=aqtr.TensorConfig(calibration=c),
      rhs=aqtr.TensorConfig(numerics=aqtr.numerics.NoNumerics()),
    )
  )


def _stateful_engine(c, x, w, eager=False):
  """(out, new_state, grads) of a stateful calibration on fwd.lhs, jitted;
  with `eager`, checked against the same run eagerly."""
  cfg = _stateful_cfg(c)
  s = aqtr.state.init(x, w, _DN, cfg)

  def f(x, w, s):
    def loss(x, w, s):
      out, new = aqtr.dot_general(x, w, _DN, cfg, state=s)
      return jnp.sum(out * out), (out, new)

    return jax.grad(loss, (0, 1, 2), has_aux=True)(x, w, s)

  got = jax.jit(f)(x, w, s)
  if eager:
    want = f(x, w, s)
    jax.tree.map(np.testing.assert_array_equal, got[1], want[1])
    close = functools.partial(np.testing.assert_allclose, rtol=1e-6)
    jax.tree.map(close, got[0], want[0])  # Sums may reorder under jit.
  return s, got


def check_stateful_engine(cls):
  """Stateful: needs state (error names the path); jit == eager; out is
  the fake quantization with the bound of the initial state."""
  c = cls()
  x, w = _input(4, (4, 16)), _input(5, (16, 3))
  with pytest.raises(ValueError, match='fwd.lhs'):
    aqtr.dot_general(x, w, _DN, _stateful_cfg(c))
  s, (grads, (out, _)) = _stateful_engine(c, x, w)
  assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))
  n = aqtr.TensorConfig().numerics
  bound, _ = c.bound_with_state(x[None, None], (3,), n, s['fwd.lhs'])
  sc = (bound / n.max_value)[0, 0]
  want = (n.quantize(x / sc).astype(jnp.float32) * sc) @ w
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def check_engine(cls, bad_fields):
  """jit-able in aqtr.dot_general; agrees with the fake-quant reference."""
  del bad_fields
  if issubclass(cls, calibrations.StatefulCalibration):
    check_stateful_engine(cls)
    return
  c = cls()
  po2 = dataclasses.replace(c, po2_scale=True)
  cc.check_in_engine(
    aqtr.TensorConfig(calibration=c),
    aqtr.TensorConfig(calibration=po2),
    exact=True,
    dots=cc.DOTS[:1],
  )


def check_bound(cls, bad_fields):
  """bound >= 0, floating, with the reduced axes kept (size 1)."""
  del bad_fields
  c = cls()
  x = _input()
  for axes in _AXES:
    b = _calibrate(c, x, axes)
    want = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    assert b.shape == want, (axes, b.shape)
    assert jnp.issubdtype(b.dtype, jnp.floating)
    assert (b >= 0).all() and jnp.isfinite(b).all()


def check_nonfinite(cls, bad_fields):
  """NaN/inf in a group: that group's bound (and dot output) non-finite."""
  del bad_fields
  c = cls()
  x = _input(1, (4, 16))
  x = x.at[0, 3].set(jnp.nan).at[1, 7].set(jnp.inf).at[2, 0].set(-jnp.inf)
  b = _calibrate(c, x, (1,))
  assert not jnp.isfinite(b[:3]).any(), b
  assert jnp.isfinite(b[3]).all() and (b[3] >= 0).all()
  w = _input(2, (16, 5))
  if isinstance(c, calibrations.StatefulCalibration):
    x4, n = x[None, None], aqtr.TensorConfig().numerics
    st = c.init_state(jnp.nan_to_num(x4), (3,), n)
    b, _ = c.bound_with_state(x4, (3,), n, st)
    assert not jnp.isfinite(b[0, 0, :3]).any(), b
    assert jnp.isfinite(b[0, 0, 3]).all()
    out = _stateful_engine(c, x, w)[1][1][0]
    assert not jnp.isfinite(out[:3]).any()
    assert jnp.isfinite(out[3]).all()
    return
  cfg = aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(
      lhs=aqtr.TensorConfig(calibration=c), rhs=aqtr.TensorConfig()
    )
  )
  out = jax.jit(
    lambda x, w: aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), cfg)
  )(x, w)
  assert not jnp.isfinite(out[:3]).any()
  assert jnp.isfinite(out[3]).all()


def check_zeros(cls, bad_fields):
  """All-zero input: no NaN; the scale is 1 wherever the bound is 0."""
  del bad_fields
  c = cls()
  x = jnp.zeros((4, 16))
  b = _calibrate(c, x, (1,))
  assert (b >= 0).all() and jnp.isfinite(b).all()
  if isinstance(c, calibrations.StatefulCalibration):
    grads, (out, new) = _stateful_engine(c, x, _input(2, (16, 5)))[1]
    for leaf in jax.tree.leaves((grads, out, new)):
      assert jnp.isfinite(leaf).all()
    np.testing.assert_array_equal(out, 0.0)
    return
  for cal in (c, dataclasses.replace(c, po2_scale=True)):
    t = aqtr.TensorConfig(calibration=cal)
    qt = jax.jit(lambda x, t=t: aqtr.quantize(x, t))(x)
    s = qt.scale.reshape(4, 1)
    assert jnp.isfinite(s).all() and (s > 0).all()
    np.testing.assert_array_equal(jnp.where(b == 0, s, 1.0), 1.0)
    np.testing.assert_array_equal(qt.dequant(), x)
    g = jax.jit(jax.grad(lambda x, t=t: aqtr.fake_quant(x, t).sum()))(x)
    assert jnp.isfinite(g).all()


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls,
    bad_fields,
    family='calibrations',
    table=__name__,
    base=calibrations.Calibration,
  )


CHECKS = (
  check_builds,
  check_static_arg,
  check_engine,
  check_bound,
  check_nonfinite,
  check_zeros,
  check_bad_fields,
)


def check_contract(cls, bad_fields):
  """Runs every contract check on the calibration class `cls`."""
  for check in CHECKS:
    check(cls, bad_fields)


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', calibrations.names())
def test_contract(name, check):
  check(calibrations.get(name), BAD_FIELDS.get(name))


@pytest.mark.slow
@pytest.mark.parametrize(
  'name',
  [
    n
    for n in calibrations.names()
    if issubclass(calibrations.get(n), calibrations.StatefulCalibration)
  ],
)
def test_stateful_jit_equals_eager(name):
  x, w = _input(4, (4, 16)), _input(5, (16, 3))
  _stateful_engine(calibrations.get(name)(), x, w, eager=True)


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(pytest.fail.Exception, match='add an entry'):
    check_bad_fields(calibrations.AbsMax, None)
  with pytest.raises(pytest.fail.Exception, match='add some'):
    check_bad_fields(calibrations.AbsMax, [])


def test_registry():
  assert {'absmax', 'constant'} <= set(calibrations.names())
  cc.check_registry(calibrations, calibrations.Calibration, unknown='abs_max')


@pytest.fixture
def scratch_registry(monkeypatch):
  """Registrations made during the test are undone afterwards."""
  reg = calibrations.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  return reg


def test_a_calibration_registered_here_passes_the_contract(scratch_registry):
  @calibrations.register('test_rms')
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Rms(calibrations.Calibration):
    """bound = c * sqrt(mean_G x^2) (ALGORITHMS.md, absmean / rms, p=2)."""

    c: float = 3.0

    def __post_init__(self):
      if not (isinstance(self.c, float) and self.c > 0):
        raise ValueError(f'Rms.c must be a float > 0, got {self.c!r}.')

    def calibrate(self, x, axes):
      return self.c * jnp.sqrt(jnp.mean(x * x, axis=tuple(axes), keepdims=True))

  assert 'test_rms' in calibrations.names()
  assert calibrations.get('test_rms') is Rms
  check_contract(Rms, [{'c': 0.0}, {'c': 1}])
  # Usable through a config, like any built-in calibration.
  t = aqtr.TensorConfig(calibration=calibrations.get('test_rms')(c=2.0))
  x = _input(3, (4, 64))
  qt = aqtr.quantize(x, t)
  rms = jnp.sqrt(jnp.mean(x * x, axis=1))
  np.testing.assert_allclose(qt.scale.ravel(), 2.0 * rms / 127, rtol=1e-6)
  assert (jnp.abs(qt.qvalue.astype(jnp.int32)) <= 127).all()


def test_a_registered_calibration_without_examples_fails(scratch_registry):
  @calibrations.register('test_untested')
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Untested(calibrations.AbsMax):
    pass

  with pytest.raises(pytest.fail.Exception, match='add an entry'):
    test_contract('test_untested', check_bad_fields)


def test_scratch_registrations_do_not_leak():
  assert 'test_rms' not in calibrations.names()
  assert 'test_untested' not in calibrations.names()
