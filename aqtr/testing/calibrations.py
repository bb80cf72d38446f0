"""The contract of the `calibrations` registry.

A calibration builds from `fdl.Config` with its defaults; it is hashable,
equal to a rebuilt one and a static `jax.jit` argument; inside a
TensorConfig, `aqtr.dot_general` runs under jit with finite gradients and
agrees with the fake-quant reference (bit for bit with `po2_scale=True`),
its VJP with autodiff of that reference; the bound is >= 0 with the reduced
axes kept; a NaN or inf in a group makes that group's bound non-finite (and
the dot's output there); `bound_of_finite` equals `bound_for` bit for bit
on finite input; all-zero input quantizes without NaN (scale 1
where the bound is 0); bad field values raise an error naming the field.
Stateful calibrations run `aqtr.testing.stateful`'s versions of the
engine, non-finite and zero checks.
`aqtr.ragged_dot` (the same plan, its group axis a batch axis) agrees with
its references in all three passes, stateful calibrations with their
per-expert state (`aqtr.testing.ragged`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import calibrations, tilings
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.quantizer import fake_quant, quantize
from aqtr.numerics import IntSymmetric
from aqtr.testing import checks as cc
from aqtr.testing import ragged, stateful

# 4-D inputs (the quantizer's [batch, tile, free, k] view) and reductions.
_AXES = ((3,), (2, 3), (1, 3), (0, 1, 2, 3))


def _input(seed=0, shape=(2, 3, 4, 8)):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * 3.0, jnp.float32)


def _calibrate(c, x, axes):
  return jax.jit(c.calibrate, static_argnums=1)(x, axes)


def _stateful(cls) -> bool:
  return issubclass(cls, calibrations.StatefulCalibration)


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  c = cc.check_builds(cls, calibrations.Calibration)
  assert c.po2_scale is False


def check_static_arg(cls, bad_fields):
  """A static jit argument."""
  del bad_fields
  cc.check_static_arg(cls, lambda c, x: c.calibrate(x, (1,)), _input()[0, 0])


def check_engine(cls, bad_fields):
  """jit-able in dot_general; agrees with the fake-quant reference."""
  del bad_fields
  if _stateful(cls):
    stateful.check_engine(cls)
    return
  c = cls()
  po2 = dataclasses.replace(c, po2_scale=True)
  cc.check_in_engine(
    TensorConfig(calibration=c),
    TensorConfig(calibration=po2),
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
  """NaN/inf in a group: that group's bound (and dot output) non-finite.

  Under jit, with the NaN/inf at the first, a middle or the last place of a
  group, all-NaN and all-inf groups, and for every reduction of a 4-D view
  (XLA:CPU's jitted max may skip NaNs: the contract must not).
  """
  del bad_fields
  c = cls()
  nan, inf = jnp.nan, jnp.inf
  x = _input(1, (8, 64))
  x = x.at[0, 3].set(nan).at[1, 7].set(inf).at[2, 0].set(-inf)
  x = x.at[3].set(nan).at[4, 63].set(nan).at[5, 10].set(nan)
  x = x.at[5, 11].set(-inf).at[6].set(inf)
  b = _calibrate(c, x, (1,))
  assert not jnp.isfinite(b[:7]).any(), b
  assert jnp.isfinite(b[7]).all() and (b[7] >= 0).all()
  where = (1, 2, 3, 5)
  x4 = _input(2).at[where].set(nan)
  for axes in _AXES:
    b = np.asarray(_calibrate(c, x4, axes))
    bad = tuple(0 if i in axes else j for i, j in enumerate(where))
    assert not np.isfinite(b[bad]), (axes, b)
    rest = np.delete(b.ravel(), np.ravel_multi_index(bad, b.shape))
    assert np.isfinite(rest).all(), (axes, b)
  if _stateful(cls):
    stateful.check_nonfinite(cls)
    return
  w = _input(2, (64, 5))
  for tiling in (tilings.PerChannel(), tilings.PerTensor()):
    cfg = DotGeneralConfig(
      fwd=DotGeneralRaw(
        lhs=TensorConfig(calibration=c, tiling=tiling), rhs=TensorConfig()
      )
    )
    out = jax.jit(
      lambda x, w, cfg=cfg: dot_general(x, w, (((1,), (0,)), ((), ())), cfg)
    )(x, w)
    assert not jnp.isfinite(out[:7]).any(), tiling
    assert jnp.isfinite(out[7]).all(), tiling


def check_finite_bound(cls, bad_fields):
  """`bound_of_finite` equals `bound_for` bit for bit on finite input.

  (The quantizer calls it on the finite values of groups that span rows.)
  """
  del bad_fields
  c = cls()
  n = IntSymmetric()
  x = _input(3).at[0, 1].set(0.0).at[1, 2, 3].set(-0.0)
  for axes in _AXES:
    want = jax.jit(c.bound_for, static_argnums=(1, 2))(x, axes, n)
    got = jax.jit(c.bound_of_finite, static_argnums=(1, 2))(x, axes, n)
    assert got.shape == want.shape, (axes, got.shape, want.shape)
    same = np.asarray(got).view(np.uint32) == np.asarray(want).view(np.uint32)
    assert same.all(), (axes, got, want)


def check_zeros(cls, bad_fields):
  """All-zero input: no NaN; the scale is 1 wherever the bound is 0."""
  del bad_fields
  if _stateful(cls):
    stateful.check_zeros(cls)
    return
  c = cls()
  x = jnp.zeros((4, 16))
  b = _calibrate(c, x, (1,))
  assert (b >= 0).all() and jnp.isfinite(b).all()
  for cal in (c, dataclasses.replace(c, po2_scale=True)):
    t = TensorConfig(calibration=cal)
    qt = jax.jit(lambda x, t=t: quantize(x, t))(x)
    s = qt.scale.reshape(4, 1)
    assert jnp.isfinite(s).all() and (s > 0).all()
    np.testing.assert_array_equal(jnp.where(b == 0, s, 1.0), 1.0)
    np.testing.assert_array_equal(qt.dequant(), x)
    g = jax.jit(jax.grad(lambda x, t=t: fake_quant(x, t).sum()))(x)
    assert jnp.isfinite(g).all()


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='calibrations', base=calibrations.Calibration
  )


def check_ragged(cls, bad_fields):
  """aqtr.ragged_dot's three passes agree with their references; stateful
  ones run with their state (serve == train from it)."""
  del bad_fields
  if _stateful(cls):
    ragged.check_stateful_ragged(cls())
    return
  ragged.check_in_ragged(TensorConfig(calibration=cls()))


CHECKS = (
  check_builds,
  check_static_arg,
  check_engine,
  check_ragged,
  check_bound,
  check_nonfinite,
  check_finite_bound,
  check_zeros,
  check_bad_fields,
)


def check_calibration(cls, bad_fields):
  """Runs every contract check on the calibration class `cls`.

  Args:
    cls: a Calibration subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
