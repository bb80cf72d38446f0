"""Sparsity in the config: slots, role tags, and bad input."""

import dataclasses

import fiddle as fdl
import jax.numpy as jnp
import pytest

import aqtr
from aqtr import presets, sparsity, tags

DN = (((1,), (0,)), ((), ()))


def _set(cfg, path: str, s):
  name, side = path.split('.')
  raw = getattr(cfg, name)
  t = dataclasses.replace(getattr(raw, side), sparsity=s)
  return dataclasses.replace(
    cfg, **{name: dataclasses.replace(raw, **{side: t})}
  )


def test_default_is_none_and_float_stays_lax():
  assert aqtr.TensorConfig().sparsity == sparsity.NoSparsity()
  assert presets.float().is_float
  assert not sparsity.configure(presets.float(), rhs='n_m').is_float


def test_n_not_below_m_names_the_fields():
  with pytest.raises(ValueError, match=r'NM\.n must be < NM\.m.*n=4, m=4'):
    sparsity.NM(n=4, m=4)


@pytest.mark.parametrize('path', ['dlhs.lhs', 'drhs.lhs'])
def test_sparsity_on_a_gradient_operand_is_an_error(path):
  with pytest.raises(ValueError) as e:
    _set(presets.int8(), path, sparsity.NM())
  msg = str(e.value)
  assert f'DotGeneralConfig.{path}.sparsity' in msg and 'gradient' in msg
  assert '\n' not in msg


def test_residual_slot_must_match_the_forward_operand():
  cfg = sparsity.configure(presets.int8(), rhs=sparsity.NM())
  assert cfg.dlhs.rhs.sparsity == cfg.fwd.rhs.sparsity
  with pytest.raises(ValueError, match=r'dlhs\.rhs\.sparsity.*fwd\.rhs'):
    _set(cfg, 'dlhs.rhs', sparsity.NM(n=1, m=4))
  with pytest.raises(ValueError, match=r'drhs\.rhs\.sparsity.*fwd\.lhs'):
    _set(presets.int8(), 'drhs.rhs', sparsity.Magnitude())


def test_m_not_dividing_the_contraction_names_the_path():
  cfg = sparsity.configure(presets.int8(), rhs=sparsity.NM(n=2, m=4))
  x, w = jnp.ones((2, 6)), jnp.ones((6, 3))
  with pytest.raises(ValueError) as e:
    aqtr.dot_general(x, w, DN, cfg)
  msg = str(e.value)
  assert msg.startswith('config.fwd.rhs.sparsity: NM(n=2, m=4')
  assert 'multiple of m * block * max(offset, 1) = 4, got 6' in msg
  with pytest.raises(ValueError, match=r'^config\.sparsity: NM'):
    aqtr.quantize(x, aqtr.TensorConfig(sparsity=sparsity.NM()))


def test_ragged_dot_prunes_experts_and_names_a_bad_size():
  cfg = sparsity.configure(presets.int8(), rhs='n_m')
  x, w = jnp.ones((3, 8)), jnp.arange(64.0).reshape(2, 8, 4)
  out = aqtr.ragged_dot(x, w, jnp.array([1, 2]), cfg)
  dense = aqtr.ragged_dot(x, w, jnp.array([1, 2]), presets.int8())
  assert float(jnp.abs(out).sum()) < float(jnp.abs(dense).sum())
  with pytest.raises(ValueError, match=r'config\.fwd\.rhs\.sparsity'):
    aqtr.ragged_dot(
      jnp.ones((3, 6)), jnp.ones((2, 6, 4)), jnp.array([1, 2]), cfg
    )


def test_role_tags_and_fiddler():
  cfg = aqtr.fiddle.config('int8')
  fdl.set_tagged(
    cfg, tag=tags.WeightSparsity, value=fdl.Config(sparsity.NM, n=1, m=4)
  )
  fdl.set_tagged(
    cfg,
    tag=tags.ActivationSparsity,
    value=fdl.Config(sparsity.Magnitude, keep=0.5),
  )
  built = aqtr.fiddle.build(cfg)
  assert built == sparsity.configure(
    presets.int8(), lhs=sparsity.Magnitude(keep=0.5), rhs=sparsity.NM(n=1)
  )
  assert built.dlhs.lhs.sparsity == sparsity.NoSparsity()
  cfg = aqtr.fiddle.config('int8')
  aqtr.fiddlers.use_sparsity(cfg, r'(fwd|dlhs)\.rhs', 'n_m', n=2, m=8)
  assert aqtr.fiddle.build(cfg).dlhs.rhs.sparsity == sparsity.NM(n=2, m=8)
  with pytest.raises(ValueError, match=r'fwd\.rhs.*NM\.n must be < NM\.m'):
    aqtr.fiddlers.use_sparsity(cfg, r'fwd\.rhs', 'n_m', n=8, m=8)
  assert tags.Sparsity in fdl.get_tags(cfg.fwd.rhs, 'sparsity')


def test_check_shapes_names_the_sparsity_path():
  cfg = sparsity.configure(presets.int8(), lhs=sparsity.NM(n=1, m=8))
  aqtr.validation.check_shapes(cfg, (4, 64), (64, 3), DN)
  with pytest.raises(ValueError, match=r'^fwd\.lhs\.sparsity: NM.*= 8, got 60'):
    aqtr.validation.check_shapes(cfg, (4, 60), (60, 3), DN)
