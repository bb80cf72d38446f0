"""The contract of the `tilings` registry.

A tiling builds from `fdl.Config` with its defaults; it is hashable, equal
to a rebuilt one and a static `jax.jit` argument; inside a TensorConfig,
`aqtr.dot_general` runs under jit with finite gradients and agrees with the
fake-quant reference (bit for bit with power-of-two scales), its VJP with
autodiff of that reference; its scales are shared exactly along the view
axes it names (always including the contraction block, so they factor out
of the integer dot; stored with size 1 along the shared `tile`/`k` axes and
full size, equal values, along shared batch/free axes, where a row holding
NaN/inf is marked); bad field values raise an error naming the field.
`aqtr.ragged_dot` (the same plan, its group axis a batch axis) agrees with
its references in all three passes (`aqtr.testing.ragged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import calibrations, tilings
from aqtr.core.config import TensorConfig
from aqtr.core.qtensor import ROLE_AXES
from aqtr.core.quantizer import fake_quant, quantize
from aqtr.testing import checks as cc
from aqtr.testing import ragged


def _tensor(tiling, po2=False):
  return TensorConfig(
    tiling=tiling, calibration=calibrations.AbsMax(po2_scale=po2)
  )


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, tilings.Tiling)


def check_static_arg(cls, bad_fields):
  """A static jit argument (through fake_quant)."""
  del bad_fields
  x = jnp.linspace(-3.0, 3.0, 4 * 256).reshape(4, 256)
  cc.check_static_arg(cls, lambda t, x: fake_quant(x, _tensor(t)), x)


def check_engine(cls, bad_fields):
  """jit-able in dot_general; agrees with the fake-quant reference."""
  del bad_fields
  t = cls()
  cc.check_in_engine(_tensor(t), _tensor(t, po2=True), exact=True)


def check_scales(cls, bad_fields):
  """Scales are shared along exactly the view axes the tiling names."""
  del bad_fields
  t = cls()
  assert isinstance(t.shared, frozenset) and t.shared <= set(tilings.ROLES)
  assert 'k' in t.shared, 'scales must be constant along the contraction'
  for k in (256, 512):
    size = t.tile(k)
    assert size is None or (
      isinstance(size, int) and 0 < size and k % size == 0
    )
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 5, 256)), jnp.float32)
  quantize_x = functools.partial(
    quantize, config=_tensor(t), contracting_axes=(3,), batch_axes=(0,)
  )
  qt = jax.jit(quantize_x)(x)
  s = np.asarray(qt.scale)
  for role, axis in ROLE_AXES['fk'].items():
    fiber = role in ('tile', 'k')
    want = 1 if role in t.shared and fiber else qt.qvalue.shape[axis]
    assert s.shape[axis] == want, (role, s.shape)
    spread = np.ptp(s, axis=axis)
    if role in t.shared:  # one value along a shared axis
      assert (spread == 0).all(), (role, s)
    elif role == 'free' and t.free_block(s.shape[axis]) is not None:
      continue  # 2-D blocks: shared within blocks of rows only
    elif s.shape[axis] > 1:  # random data: groups along it differ
      assert (spread > 0).all(), (role, s)
  assert jnp.isfinite(qt.dequant()).all()
  np.testing.assert_allclose(
    qt.dequant(), x, atol=float(jnp.abs(x).max()) / 127
  )


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(cls, bad_fields, family='tilings', base=tilings.Tiling)


def check_ragged(cls, bad_fields):
  """aqtr.ragged_dot's three passes agree with their references (a tiling
  of the token axis refused in drhs)."""
  del bad_fields
  ragged.check_in_ragged(_tensor(cls()))


CHECKS = (
  check_builds,
  check_static_arg,
  check_engine,
  check_ragged,
  check_scales,
  check_bad_fields,
)


def check_tiling(cls, bad_fields):
  """Runs every contract check on the tiling class `cls`.

  Args:
    cls: a Tiling subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
