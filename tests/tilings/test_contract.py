"""Contract test of the `tilings` registry (DESIGN.md section 4).

Every registered tiling is tested the moment it registers: it builds from
`fdl.Config` with its defaults; it is hashable, equal to a rebuilt one and a
static `jax.jit` argument; inside a TensorConfig, `aqtr.dot_general` runs
under jit with finite gradients and agrees with the fake-quant reference
(bit for bit with power-of-two scales), its VJP with autodiff of that
reference; its scales are shared exactly along the view axes it names
(always including the contraction block, so they factor out of the integer
dot); bad field values raise an error naming the field (BAD_FIELDS below).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import contract_checks as cc

import aqtr
from aqtr import calibrations, tilings
from aqtr.core.qtensor import ROLE_AXES

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# tiling needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'block2d': [
    {'tile_size': 0},
    {'free_size': -1},
    {'free_size': 2.0},
    {'tile_size': True},
  ],
  'per_channel': [],
  'per_tensor': [],
  'subchannel': [
    {'tile_size': -1},
    {'tile_size': 2.5},
    {'tile_size': True},
    {'tile_size': '128'},
    {'tile_count': -4},
    {'tile_count': 4.0},
    {'tile_size': 64, 'tile_count': 4},
  ],
}


def _tensor(tiling, po2=False):
  return aqtr.TensorConfig(
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
  cc.check_static_arg(cls, lambda t, x: aqtr.fake_quant(x, _tensor(t)), x)


def check_engine(cls, bad_fields):
  """jit-able in aqtr.dot_general; agrees with the fake-quant reference."""
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
  quantize = functools.partial(
    aqtr.quantize, config=_tensor(t), contracting_axes=(3,), batch_axes=(0,)
  )
  qt = jax.jit(quantize)(x)
  for role, axis in ROLE_AXES['fk'].items():
    want = 1 if role in t.shared else qt.qvalue.shape[axis]
    assert qt.scale.shape[axis] == want, (role, qt.scale.shape)
  assert jnp.isfinite(qt.dequant()).all()
  np.testing.assert_allclose(
    qt.dequant(), x, atol=float(jnp.abs(x).max()) / 127
  )


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='tilings', table=__name__, base=tilings.Tiling
  )


CHECKS = (
  check_builds,
  check_static_arg,
  check_engine,
  check_scales,
  check_bad_fields,
)


def check_contract(cls, bad_fields):
  """Runs every contract check on the tiling class `cls`."""
  for check in CHECKS:
    check(cls, bad_fields)


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', tilings.names())
def test_contract(name, check):
  check(tilings.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(pytest.fail.Exception, match='add an entry'):
    check_bad_fields(tilings.SubChannel, None)
  with pytest.raises(pytest.fail.Exception, match='add some'):
    check_bad_fields(tilings.SubChannel, [])
  check_bad_fields(tilings.PerTensor, [])


def test_registry():
  assert {'per_tensor', 'per_channel', 'subchannel'} <= set(tilings.names())
  cc.check_registry(tilings, tilings.Tiling, unknown='per_row')
