"""Contract test of the `freezers` registry (DESIGN.md section 4).

Every registered freezer is tested the moment it registers: it builds from
`fdl.Config` with its defaults; it is hashable, equal to a rebuilt one and a
static `jax.jit` argument; it says for every Mode which QTensor parts it
stores (nothing in TRAIN and SERVE; a subset of `frozen_parts` in CONVERT)
and rejects a non-Mode naming `mode`; inside a TensorConfig it leaves
`aqtr.dot_general` (which quantizes on the fly, as in TRAIN) unchanged,
values and gradients, under jit; bad field values raise an error naming the
field (BAD_FIELDS below).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import contract_checks as cc

import aqtr
from aqtr import calibrations, freezers
from aqtr.freezers import Mode

# Per registered name: keyword arguments that must raise TypeError or
# ValueError with a message naming each of their fields. A newly registered
# freezer needs an entry ([] only for a class without fields).
BAD_FIELDS = {
  'calibration': [
    {'per_channel': 1},
    {'per_channel': 'yes'},
    {'per_channel': None},
  ],
  'none': [],
  'weights': [],
}


def _tensor(f, po2=False):
  return aqtr.TensorConfig(
    freezer=f, calibration=calibrations.AbsMax(po2_scale=po2)
  )


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, freezers.Freezer)


def check_static_arg(cls, bad_fields):
  """A static jit argument (through fake_quant)."""
  del bad_fields
  x = jnp.linspace(-3.0, 3.0, 24).reshape(4, 6)
  cc.check_static_arg(cls, lambda f, x: aqtr.fake_quant(x, _tensor(f)), x)


def check_modes(cls, bad_fields):
  """stores(mode) for every Mode; a non-Mode raises naming `mode`."""
  del bad_fields
  f = cls()
  parts = cls.frozen_parts
  assert isinstance(parts, tuple) and all(isinstance(p, str) for p in parts)
  assert isinstance(cls.collects, bool)
  for mode in Mode:
    stored = f.stores(mode)
    assert isinstance(stored, tuple) and set(stored) <= set(parts), mode
  assert f.stores(Mode.TRAIN) == () and f.stores(Mode.SERVE) == ()
  for bad in ('convert', None, 2):
    with pytest.raises(TypeError, match='mode'):
      f.stores(bad)


def check_engine(cls, bad_fields):
  """In a TensorConfig: aqtr.dot_general unchanged (values and gradients).

  The engine quantizes on the fly as in TRAIN; the freezer only matters to
  the framework adapters, so the freezer-less result is the reference.
  """
  del bad_fields
  dn = (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
  results = []
  for t in (_tensor(cls()), _tensor(freezers.NoFreezer())):
    cfg = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))
    f = jax.value_and_grad(
      lambda x, w, c=cfg: aqtr.dot_general(x, w, dn, c).sum(), (0, 1)
    )
    results.append(jax.jit(f)(x, w))
  jax.tree.map(np.testing.assert_array_equal, *results)
  assert all(jnp.isfinite(g).all() for g in results[0][1])


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='freezers', table=__name__, base=freezers.Freezer
  )


CHECKS = (
  check_builds,
  check_static_arg,
  check_modes,
  check_engine,
  check_bad_fields,
)


def check_contract(cls, bad_fields):
  """Runs every contract check on the freezer class `cls`."""
  for check in CHECKS:
    check(cls, bad_fields)


@pytest.mark.parametrize('check', CHECKS, ids=lambda c: c.__name__[6:])
@pytest.mark.parametrize('name', freezers.names())
def test_contract(name, check):
  check(freezers.get(name), BAD_FIELDS.get(name))


def test_missing_bad_field_entry_fails_with_a_hint():
  with pytest.raises(pytest.fail.Exception, match='add an entry'):
    check_bad_fields(freezers.NoFreezer, None)
  check_bad_fields(freezers.NoFreezer, [])


def test_registry():
  assert 'none' in freezers.names()
  cc.check_registry(freezers, freezers.Freezer, unknown='frozen')
