"""Tests of aqtr.numerics.Nf4 and the Codebook base."""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics, tilings
from aqtr.core.rounding import Stochastic
from aqtr.numerics import Codebook, Nf4
from aqtr.testing import numerics as contract

from .test_ternary import dot_dtypes


def test_table_is_the_papers_construction():
  # QLoRA (Dettmers et al. 2023), appendix: quantiles of N(0, 1) at
  # linspace(offset, 1/2, 9)[:-1] (positive) and 8 (negative), offset =
  # (1 - 1/(2*15) + 1 - 1/(2*16)) / 2, normalized to [-1, 1], plus 0.
  offset = 1 - (1 / 32 + 1 / 30) / 2
  ppf = np.vectorize(statistics.NormalDist().inv_cdf)
  pos = ppf(np.linspace(offset, 0.5, 9)[:-1])
  neg = -ppf(np.linspace(offset, 0.5, 8)[:-1])
  v = np.sort(np.concatenate([pos, [0.0], neg]))
  np.testing.assert_allclose(Nf4.table, v / np.abs(v).max(), atol=1e-6)
  assert len(Nf4.table) == 16 and Nf4().max_value == 1.0


def test_rounds_to_the_nearest_table_value():
  t = np.asarray(Nf4.table, np.float32)
  v = np.random.default_rng(0).uniform(-1.5, 1.5, 4000).astype(np.float32)
  want = t[np.argmin(np.abs(v[:, None] - t[None]), axis=1)]
  np.testing.assert_array_equal(Nf4().quantize(jnp.asarray(v)), want)
  q = Nf4().quantize(jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
  np.testing.assert_array_equal(q, [np.nan, 1.0, -1.0])


def test_block_absmax_by_hand():
  # Blocks of 4: scale = max|block|; 0.5 of a block of max 2 -> 0.25,
  # nearest table value 0.24611 (between 0.16093 and 0.33792).
  w = jnp.array([[2.0, 0.5, -1.0, 0.0, 0.1, 0.1, 0.1, -0.4]])
  t = aqtr.TensorConfig(numerics=Nf4(), tiling=tilings.SubChannel(tile_size=4))
  qt = aqtr.quantize(w, t)
  np.testing.assert_allclose(qt.scale.ravel(), [2.0, 0.4], rtol=1e-6)
  want = [2.0, 2 * 0.24611230194568634, -2 * 0.5250730514526367, 0.0]
  want += [0.4 * 0.24611230194568634] * 3 + [-0.4]
  np.testing.assert_allclose(qt.dequant().ravel(), want, rtol=1e-6)


def test_weight_only_dot_runs_in_float32():
  t = aqtr.TensorConfig(numerics=Nf4())
  none = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  cfg = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=none, rhs=t))
  x, w = jnp.ones((4, 16)), jnp.ones((16, 3))
  dn = (((1,), (0,)), ((), ()))
  assert dot_dtypes(lambda x, w: aqtr.dot_general(x, w, dn, cfg), x, w) == [
    ('float32', 'float32')
  ]


@pytest.mark.parametrize('pass_', ['dlhs', 'drhs'])
def test_nf4_on_gradients_fails_at_config_build(pass_):
  t = aqtr.TensorConfig(numerics=Nf4())
  with pytest.raises(ValueError, match=rf'{pass_}\.lhs\.numerics: Nf4 is not'):
    aqtr.DotGeneralConfig(**{pass_: aqtr.DotGeneralRaw(lhs=t)})
  # On the residual operand it is allowed.
  aqtr.DotGeneralConfig(**{pass_: aqtr.DotGeneralRaw(rhs=t)})


def test_stochastic_rounding_fails_at_config_build():
  with pytest.raises(ValueError, match='TensorConfig.rounding: Nf4'):
    aqtr.TensorConfig(numerics=Nf4(), rounding=Stochastic())
  with pytest.raises(ValueError, match='stochastic'):
    Nf4().quantize(jnp.zeros(2), jnp.zeros(2))


def test_mse_calibration_searches_with_the_table():
  x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
  ts = [
    aqtr.TensorConfig(numerics=Nf4(), calibration=c)
    for c in (calibrations.AbsMax(), calibrations.Mse())
  ]
  errs = jax.jit(
    lambda x: [jnp.sum((aqtr.fake_quant(x, t) - x) ** 2, 1) for t in ts]
  )(x)
  assert (errs[1] <= errs[0]).all() and (errs[1] < errs[0]).any()


@pytest.fixture
def scratch_registry(monkeypatch):
  reg = numerics.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  return reg


def test_a_user_codebook_registers_and_passes_the_contract(scratch_registry):
  @numerics.register('test_five')
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Five(Codebook):
    table = (-2.0, -0.5, 0.0, 0.5, 2.0)

  assert numerics.get('test_five') is Five and Five().max_value == 2.0
  # The contract minus the engine check (nf4 runs that one).
  for check in contract.CHECKS:
    if check is not contract.check_engine:
      check(Five, [])
  q = jax.jit(Five().quantize)(jnp.array([-0.3, 0.2, 0.25, 1.3, 9.0]))
  np.testing.assert_array_equal(q, [-0.5, 0.0, 0.0, 2.0, 2.0])


@pytest.mark.parametrize(
  'table', [(), (1.0,), (0.0, 0.0), (1.0, 0.0), (0.0, float('inf')), [0, 1]]
)
def test_bad_tables_name_the_field(table):
  cls = type('Bad', (Codebook,), {'table': table})
  with pytest.raises(TypeError, match=r'Bad\.table must be a tuple'):
    cls()


def test_registered_as_nf4():
  assert numerics.get('nf4') is Nf4
