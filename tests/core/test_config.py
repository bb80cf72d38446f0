"""Tests for the frozen config tree (aqtr/core/config.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import aqtr
from aqtr import calibrations, numerics, tilings
from aqtr.core import config as config_lib


def test_defaults():
  t = aqtr.TensorConfig()
  assert t.numerics == numerics.IntSymmetric(bits=8)
  assert t.calibration == calibrations.AbsMax()
  assert t.tiling == tilings.PerChannel()
  assert t.rounding == aqtr.NearestEven()
  assert t.quantized
  raw = aqtr.DotGeneralRaw()
  assert not raw.use_fwd_quant and raw.accumulator == 'auto'
  cfg = aqtr.DotGeneralConfig()
  assert not cfg.fwd.use_fwd_quant
  assert cfg.dlhs.use_fwd_quant and cfg.drhs.use_fwd_quant
  assert not cfg.is_float


@pytest.mark.parametrize(
  'cls', [aqtr.TensorConfig, aqtr.DotGeneralRaw, aqtr.DotGeneralConfig]
)
def test_configs_are_frozen_kw_only_and_hashable(cls):
  a, b = cls(), cls()
  assert a == b and hash(a) == hash(b)
  assert len({a, b}) == 1
  field = dataclasses.fields(cls)[0].name
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(a, field, None)
  with pytest.raises(TypeError):
    cls(getattr(a, field))  # positional arguments are not accepted
  params = cls.__dataclass_params__
  assert params.frozen
  for f in dataclasses.fields(cls):
    assert f.kw_only
    has_default = (
      f.default is not dataclasses.MISSING
      or f.default_factory is not dataclasses.MISSING
    )
    assert has_default, f.name


def test_different_configs_differ():
  a = aqtr.TensorConfig(numerics=numerics.IntSymmetric(bits=4))
  assert a != aqtr.TensorConfig()
  assert aqtr.presets.int8() != aqtr.presets.int8_fwd()


def test_config_is_a_static_jit_argument():
  traces = []

  def f(x, cfg):
    traces.append(cfg)
    return aqtr.fake_quant(x, cfg)

  g = jax.jit(f, static_argnums=1)
  x = jnp.ones((2, 4))
  g(x, aqtr.TensorConfig())
  g(x, aqtr.TensorConfig())  # equal config: cache hit
  g(x, aqtr.TensorConfig(numerics=numerics.IntSymmetric(bits=4)))
  assert len(traces) == 2


@pytest.mark.parametrize(
  'field', ['numerics', 'calibration', 'tiling', 'rounding']
)
def test_tensor_config_checks_types(field):
  with pytest.raises(TypeError, match=f'TensorConfig.{field} must be'):
    aqtr.TensorConfig(**{field: 'int8'})


def test_tensor_config_rejects_wrong_family():
  with pytest.raises(TypeError, match='TensorConfig.numerics'):
    aqtr.TensorConfig(numerics=calibrations.AbsMax())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NoSr(numerics.NoNumerics):
  quantizes = True  # A quantizing numerics without stochastic rounding.


def test_stochastic_rounding_needs_a_numerics_that_supports_it():
  with pytest.raises(ValueError, match='TensorConfig.rounding.*_NoSr'):
    aqtr.TensorConfig(numerics=_NoSr(), rounding=aqtr.Stochastic())
  with pytest.raises(ValueError, match='preserve_max_val'):
    aqtr.TensorConfig(
      numerics=numerics.IntSymmetric(preserve_max_val=False),
      rounding=aqtr.Stochastic(),
    )
  # unquantized operands ignore the rounding
  t = aqtr.TensorConfig(
    numerics=numerics.NoNumerics(), rounding=aqtr.Stochastic()
  )
  assert not t.quantized
  assert aqtr.TensorConfig(rounding=aqtr.Stochastic()).rounding.stochastic


def test_dot_general_raw_validation():
  with pytest.raises(TypeError, match='DotGeneralRaw.lhs'):
    aqtr.DotGeneralRaw(lhs=numerics.IntSymmetric())
  with pytest.raises(TypeError, match='DotGeneralRaw.rhs'):
    aqtr.DotGeneralRaw(rhs=None)
  with pytest.raises(TypeError, match='use_fwd_quant must be a bool'):
    aqtr.DotGeneralRaw(use_fwd_quant=1)
  with pytest.raises(ValueError, match="accumulator must be one of.*'auto'"):
    aqtr.DotGeneralRaw(accumulator='int16')
  fp8 = aqtr.TensorConfig(numerics=numerics.Fp8())
  with pytest.raises(ValueError, match="accumulator='int32'.*lhs has Fp8"):
    aqtr.DotGeneralRaw(lhs=fp8, accumulator='int32')
  flt = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  with pytest.raises(ValueError, match='rhs has NoNumerics'):
    aqtr.DotGeneralRaw(rhs=flt, accumulator='int32')
  # the reused forward operand is not this config's rhs: no check on it
  aqtr.DotGeneralRaw(rhs=flt, use_fwd_quant=True, accumulator='int32')


def test_dot_general_raw_quantized():
  flt = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  q = aqtr.TensorConfig()
  assert aqtr.DotGeneralRaw(lhs=q, rhs=flt).quantized
  assert aqtr.DotGeneralRaw(lhs=flt, rhs=q).quantized
  assert not aqtr.DotGeneralRaw(lhs=flt, rhs=q, use_fwd_quant=True).quantized
  assert not aqtr.DotGeneralRaw(lhs=flt, rhs=flt).quantized


def test_dot_general_config_validation():
  for field in ('fwd', 'dlhs', 'drhs'):
    with pytest.raises(TypeError, match=f'DotGeneralConfig.{field}'):
      aqtr.DotGeneralConfig(**{field: aqtr.TensorConfig()})
  with pytest.raises(ValueError, match='fwd.use_fwd_quant must be False'):
    aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(use_fwd_quant=True))


@pytest.mark.parametrize('slot', ['dlhs.lhs', 'drhs.lhs', 'dlhs.rhs'])
def test_quantized_gather_off_the_forward_operands_raises(slot):
  # It was accepted and ignored (only forward operands are gathered).
  cfg = aqtr.presets.int8()
  name, side = slot.split('.')
  t = dataclasses.replace(
    getattr(getattr(cfg, name), side), quantized_gather=True
  )
  raw = dataclasses.replace(getattr(cfg, name), **{side: t})
  with pytest.raises(ValueError, match=rf'{slot}\.quantized_gather=True'):
    dataclasses.replace(cfg, **{name: raw})
  # A residual slot may follow its forward operand.
  fwd = dataclasses.replace(
    cfg.fwd, rhs=dataclasses.replace(cfg.fwd.rhs, quantized_gather=True)
  )
  if slot == 'dlhs.rhs':
    dataclasses.replace(cfg, fwd=fwd, dlhs=raw)


def test_quantized_gather_on_a_float_operand_raises():
  cfg = aqtr.presets.int8_weight_only()  # float activations
  lhs = dataclasses.replace(cfg.fwd.lhs, quantized_gather=True)
  with pytest.raises(ValueError, match=r'fwd\.lhs\.quantized_gather=True but'):
    dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, lhs=lhs))


def test_is_float():
  assert config_lib.float_config().is_float
  assert aqtr.presets.float().is_float
  assert config_lib.float_config() == aqtr.presets.float()
  assert not aqtr.presets.int8_fwd().is_float
  assert not aqtr.presets.int8_weight_only().is_float


@pytest.mark.parametrize('bits', [0, 9, 16, -1])
def test_bits_out_of_range(bits):
  with pytest.raises(ValueError, match=r'IntSymmetric.bits must be in 1\.\.8'):
    numerics.IntSymmetric(bits=bits)


@pytest.mark.parametrize('bits', [8.0, True, '8'])
def test_bits_must_be_an_int(bits):
  with pytest.raises(TypeError, match='IntSymmetric.bits'):
    numerics.IntSymmetric(bits=bits)


def test_accumulator_float32_runs_a_float_dot():
  raw = aqtr.DotGeneralRaw(accumulator='float32')
  cfg = aqtr.DotGeneralConfig(fwd=raw)
  x, w = jnp.ones((2, 8)), jnp.ones((8, 3))
  dn = (((1,), (0,)), ((), ()))
  jaxpr = str(
    jax.make_jaxpr(lambda x, w: aqtr.dot_general(x, w, dn, cfg))(x, w)
  )
  assert 'preferred_element_type=int32' not in jaxpr
  out = aqtr.dot_general(x, w, dn, cfg)
  assert out.tolist() == [[8.0] * 3] * 2
