"""The contract of the `freezers` registry.

A freezer builds from `fdl.Config` with its defaults; it is hashable, equal
to a rebuilt one and a static `jax.jit` argument; it says for every Mode
which parts it stores (nothing in TRAIN and SERVE; a subset of
`frozen_parts` in CONVERT) and rejects a non-Mode naming `mode`; inside a
TensorConfig it leaves `aqtr.dot_general` (which quantizes on the fly, as
in TRAIN) unchanged, values and gradients, under jit; it goes through the
whole life cycle on a dot's weights (CALIBRATE, CONVERT, SERVE, under jit):
CONVERT stores exactly `frozen_parts`, SERVE from them equals CONVERT's
output and is close to the float dot (of the operands as pruned by the
config's sparsity), and does not read the float weights
when `reads_float` is False; bad field values raise an error naming the
field.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import calibrations, freezers, presets, sparsity
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.quantizer import fake_quant
from aqtr.freezers import Mode, lifecycle
from aqtr.testing import checks as cc

# The configs the life cycle is tried with, in order: a freezer must work
# with one of them and reject the others with a ValueError.
PRESETS = ('int8', 'int4_weight_only', 'fp8', 'int8_sparse_2_4')
_DN = (((1,), (0,)), ((), ()))


def _tensor(f, po2=False):
  return TensorConfig(freezer=f, calibration=calibrations.AbsMax(po2_scale=po2))


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, freezers.Freezer)


def check_static_arg(cls, bad_fields):
  """A static jit argument (through fake_quant)."""
  del bad_fields
  x = jnp.linspace(-3.0, 3.0, 24).reshape(4, 6)
  cc.check_static_arg(cls, lambda f, x: fake_quant(x, _tensor(f)), x)


def check_modes(cls, bad_fields):
  """stores(mode) for every Mode; a non-Mode raises naming `mode`."""
  del bad_fields
  f = cls()
  parts = cls.frozen_parts
  assert isinstance(parts, tuple) and all(isinstance(p, str) for p in parts)
  assert isinstance(cls.collects, bool) and isinstance(cls.reads_float, bool)
  for mode in Mode:
    stored = f.stores(mode)
    assert isinstance(stored, tuple) and set(stored) <= set(parts), mode
  assert f.stores(Mode.TRAIN) == () and f.stores(Mode.SERVE) == ()
  for bad in ('convert', None, 2):
    with cc.raises(TypeError) as err:
      f.stores(bad)
    assert 'mode' in str(err[0])


def check_engine(cls, bad_fields):
  """In a TensorConfig: dot_general unchanged (values and gradients).

  The engine quantizes on the fly as in TRAIN; the freezer only matters to
  the framework adapters, so the freezer-less result is the reference.
  """
  del bad_fields
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
  results = []
  for t in (_tensor(cls()), _tensor(freezers.NoFreezer())):
    cfg = DotGeneralConfig(fwd=DotGeneralRaw(lhs=t, rhs=t))
    f = jax.value_and_grad(
      lambda x, w, c=cfg: dot_general(x, w, _DN, c).sum(), (0, 1)
    )
    results.append(jax.jit(f)(x, w))
  jax.tree.map(np.testing.assert_array_equal, *results)
  assert all(jnp.isfinite(g).all() for g in results[0][1])


def _life_cycle(cfg, f, x, w):
  """CALIBRATE (twice if it collects), CONVERT, SERVE; checks each step."""

  @jax.jit
  def calibrate(x, w, stats):
    return lifecycle.run(
      lifecycle.DotCall(x, w, _DN, cfg), Mode.CALIBRATE, stats=stats
    ).stats

  stats = None
  for i in range(2 if f.collects else 1):
    stats = calibrate(x * (1 + i), w, stats)
  assert set(stats or {}) == ({'rhs'} if f.collects else set()), stats

  @jax.jit
  def convert(x, w):
    r = lifecycle.run(
      lifecycle.DotCall(x, w, _DN, cfg), Mode.CONVERT, stats=stats
    )
    return r.out, r.frozen

  out, frozen = convert(x, w)
  if isinstance(f, freezers.NoFreezer):  # On the fly in every mode.
    assert frozen is None
    train = lifecycle.run(lifecycle.DotCall(x, w, _DN, cfg), Mode.TRAIN).out
    np.testing.assert_array_equal(out, train)
    return
  part = frozen['rhs']
  assert set(part) == set(f.frozen_parts) == set(f.stores(Mode.CONVERT))
  assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(part))

  @jax.jit
  def serve(x, w, frozen):
    return lifecycle.run(
      lifecycle.DotCall(x, w, _DN, cfg), Mode.SERVE, frozen=frozen
    ).out

  np.testing.assert_array_equal(serve(x, w, frozen), out)
  assert jnp.isfinite(out).all()
  # The float dot of the operands as the config prunes them.
  float_cfg = sparsity.configure(
    presets.float(), lhs=cfg.fwd.lhs.sparsity, rhs=cfg.fwd.rhs.sparsity
  )
  ref = dot_general(x, w, _DN, float_cfg)
  err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  assert err < 0.25, f'SERVE is far from the float dot: relative error {err}'
  if not f.reads_float:
    np.testing.assert_array_equal(serve(x, 0 * w, frozen), out)


def check_life_cycle(cls, bad_fields):
  """On a dot's weights: CALIBRATE, CONVERT, SERVE work under jit.

  Tried with each preset in PRESETS: one must work, the others may raise a
  ValueError (e.g. a freezer that needs int4 storage).
  """
  del bad_fields
  f = cls()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  rejected = []
  for name in PRESETS:
    cfg = freezers.configure(getattr(presets, name)(), rhs=f)
    try:
      _life_cycle(cfg, f, x, w)
    except ValueError as e:
      rejected.append(f'{name}: {e}')
      continue
    return
  raise cc.ContractError(
    f'{cls.__qualname__} works with none of the presets {PRESETS}: '
    + ' | '.join(rejected)
  )


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(cls, bad_fields, family='freezers', base=freezers.Freezer)


CHECKS = (
  check_builds,
  check_static_arg,
  check_modes,
  check_engine,
  check_life_cycle,
  check_bad_fields,
)


def check_freezer(cls, bad_fields):
  """Runs every contract check on the freezer class `cls`.

  Args:
    cls: a Freezer subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
