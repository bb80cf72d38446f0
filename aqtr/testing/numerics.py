"""The contract of the `numerics` registry.

A numerics builds from `fdl.Config` with its defaults; it is hashable,
equal to a rebuilt one and a static `jax.jit` argument; inside a
TensorConfig, `aqtr.dot_general` runs under jit with finite gradients, its
forward agrees with the fake-quant reference (bit for bit for integer
numerics with power-of-two scales) and, with float backward passes reusing
the forward quantization, its VJP agrees with autodiff of the fake-quant
reference; stored values have the numerics' dtype and lie within its range;
bad field values raise an error naming the field.
`aqtr.ragged_dot` (the same plan, its group axis a batch axis) agrees with
its references in all three passes (`aqtr.testing.ragged`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import calibrations, numerics, tilings
from aqtr.core.config import TensorConfig
from aqtr.core.quantizer import fake_quant, quantize
from aqtr.testing import checks as cc
from aqtr.testing import ragged


def _tensor(n, po2=False):
  """`n` with absmax (minmax when asymmetric), the tiling it asks for."""
  cal = calibrations.MinMax if n.asymmetric else calibrations.AbsMax
  block = n.block_size if n.quantizes else None
  tiling = (
    tilings.PerChannel()
    if block is None
    else tilings.SubChannel(tile_size=block)
  )
  return TensorConfig(numerics=n, calibration=cal(po2_scale=po2), tiling=tiling)


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, numerics.Numerics)


def check_static_arg(cls, bad_fields):
  """A static jit argument (through fake_quant)."""
  del bad_fields
  x = jnp.linspace(-3.0, 3.0, 256).reshape(4, 64)
  cc.check_static_arg(cls, lambda n, x: fake_quant(x, _tensor(n)), x)


def check_engine(cls, bad_fields):
  """jit-able in dot_general; agrees with the fake-quant reference."""
  del bad_fields
  n = cls()
  exact = n.kind == 'int' or not n.quantizes
  cc.check_in_engine(
    _tensor(n), _tensor(n, po2=True), exact=exact, dots=cc.DOTS[:1]
  )


def check_values(cls, bad_fields):
  """Stored values have the numerics' dtype and lie in its range."""
  del bad_fields
  n = cls()
  x = jnp.asarray(np.random.default_rng(0).normal(0, 3, (16, 64)), jnp.float32)
  qt = jax.jit(lambda x: quantize(x, _tensor(n)))(x)
  if not n.quantizes:
    np.testing.assert_array_equal(qt.dequant(), x)
    return
  assert n.kind in ('int', 'float')
  assert jnp.issubdtype(n.dtype, jnp.integer) == (n.kind == 'int')
  assert qt.qvalue.dtype == n.dtype
  # Values far outside the range (and +-inf) are clipped into it.
  m = n.max_value
  v = jnp.concatenate(
    [jnp.linspace(-4 * m, 4 * m, 4097), jnp.array([-jnp.inf, jnp.inf])]
  )
  outs = [jax.jit(n.quantize)(v)]
  if n.supports_stochastic_rounding:
    u = np.random.default_rng(0).uniform(-0.5, 0.5, v.shape)
    outs.append(jax.jit(n.quantize)(v, jnp.asarray(u, jnp.float32)))
  for q in [*outs, qt.qvalue]:
    assert q.dtype == n.dtype
    mag = jnp.abs(q.astype(jnp.float32)) * n.unit
    assert float(mag.max()) <= m
  assert jnp.isfinite(qt.dequant()).all()
  # The dequantized tensor stays within the calibrated bound (absmax) when
  # the numerics maps the bound onto max_value (the default scale).
  if n.asymmetric or n.block_size is not None:
    return
  bound = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  assert (jnp.abs(qt.dequant()) <= bound * (1 + 1e-6)).all()


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='numerics', base=numerics.Numerics
  )


def check_ragged(cls, bad_fields):
  """aqtr.ragged_dot's three passes agree with their references."""
  del bad_fields
  ragged.check_in_ragged(_tensor(cls()))


CHECKS = (
  check_builds,
  check_static_arg,
  check_engine,
  check_ragged,
  check_values,
  check_bad_fields,
)


def check_numerics(cls, bad_fields):
  """Runs every contract check on the numerics class `cls`.

  Args:
    cls: a Numerics subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
