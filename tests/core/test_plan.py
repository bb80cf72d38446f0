"""The plan of one call (aqtr/core/plan.py) and the operand slots (slots.py).

The plan is the one place the engine's static facts are computed; these
tests pin them against what the passes do, and check that errors about a
backward pass name its slot and the contraction it runs.
"""

import jax
import jax.numpy as jnp
import pytest

import aqtr
from aqtr.core.plan import Plan
from aqtr.core.slots import GRADIENT_SLOTS, Pass, Side, Slot

DN = (((1,), (0,)), ((), ()))


def _struct(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_slot_paths_round_trip_and_order():
  assert [s.path for s in Slot] == [
    'fwd.lhs',
    'fwd.rhs',
    'dlhs.lhs',
    'dlhs.rhs',
    'drhs.lhs',
    'drhs.rhs',
  ]
  for s in Slot:
    assert Slot.parse(s.path) is s
    assert Slot.of(s.pass_, s.side) is s
  assert sorted(reversed(list(Slot))) == list(Slot)
  assert GRADIENT_SLOTS == (Slot.DLHS_LHS, Slot.DRHS_LHS)
  assert Side.LHS.grad_pass is Pass.DLHS and Side.RHS.other is Side.LHS
  assert Slot.FWD_RHS.schedule_path == 'fwd.rhs.sparsity'


def test_slot_parse_names_the_allowed_paths():
  with pytest.raises(ValueError, match=r"'fwd\.mid'.*allowed.*'drhs\.rhs'"):
    Slot.parse('fwd.mid')


def test_dense_weights_plan():
  p = Plan.create(_struct(4, 64), _struct(64, 8), DN, aqtr.presets.int8())
  assert (p.lhs.form, p.rhs.form) == ('fk', 'kf')
  assert p.lhs.reused and p.rhs.reused and p.transposed_lhs
  assert p.view(Slot.FWD_LHS) == (1, 1, 4, 64)
  assert p.view(Slot.FWD_RHS) == (1, 1, 64, 8)
  # g [M, N]: dlhs contracts N (last), drhs contracts M ('kf').
  assert p.view(Slot.DLHS_LHS) == (1, 1, 4, 8)
  assert p.view(Slot.DRHS_LHS) == (1, 1, 4, 8)
  assert p.out_shape == (4, 8) and p.out_dtype == jnp.float32


def test_grad_copies_follow_the_forward_tiles():
  t = aqtr.TensorConfig(tiling=aqtr.tilings.SubChannel(tile_size=16))
  fwd = aqtr.DotGeneralRaw(lhs=t, rhs=t)
  cfg = aqtr.DotGeneralConfig(fwd=fwd)
  p = Plan.create(_struct(4, 64), _struct(64, 8), DN, cfg)
  assert p.fwd_tile == 16
  # One copy of g per tile of the reused partner (its scales differ).
  assert p.grad_copies(Side.LHS) == 4 and p.grad_copies(Side.RHS) == 4
  assert p.view(Slot.DLHS_LHS) == (4, 1, 4, 8)


def test_requantized_residual_plan():
  raw = aqtr.DotGeneralRaw(use_fwd_quant=False)
  cfg = aqtr.DotGeneralConfig(dlhs=raw, drhs=raw)
  p = Plan.create(_struct(4, 64), _struct(64, 8), DN, cfg)
  assert not p.lhs.reused and not p.rhs.reused and not p.transposed_lhs
  # dlhs requantizes R [K, N] contracting N: R's natural 'kf' flipped.
  assert p.form(Slot.DLHS_RHS) == 'fk'
  assert p.canonical_shape(Slot.DLHS_RHS) == (1, 64, 8)
  assert p.form(Slot.DRHS_RHS) == 'kf'


@pytest.mark.parametrize(
  ('x', 'w', 'match'),
  [
    ((8, 64), (64, 16), r'^dlhs\.lhs: .*blocks of 32.*contracts N=16'),
    ((48, 64), (64, 32), r'^drhs\.lhs: .*blocks of 32.*contracts M=48'),
  ],
)
def test_gradient_pass_block_errors_name_slot_and_size(x, w, match):
  xs = jax.random.normal(jax.random.key(0), x)
  ws = jax.random.normal(jax.random.key(1), w)
  cfg = aqtr.presets.mxfp8()
  aqtr.dot_general(xs, ws, DN, cfg)  # The forward alone is fine.
  with pytest.raises(ValueError, match=match) as e:
    jax.grad(lambda a, b: aqtr.dot_general(a, b, DN, cfg).sum(), (0, 1))(xs, ws)
  assert 'divisor' not in str(e.value)  # Fixed blocks: no divisor hint.


def test_gradient_pass_tiling_error_names_the_contraction():
  t = aqtr.TensorConfig(tiling=aqtr.tilings.SubChannel(tile_size=32))
  raw = aqtr.DotGeneralRaw(lhs=t, use_fwd_quant=True)
  cfg = aqtr.DotGeneralConfig(dlhs=raw)
  x = jnp.ones((8, 64))
  w = jnp.ones((64, 16))
  with pytest.raises(ValueError, match=r'dlhs\.lhs: .*contracts N=16'):
    jax.grad(lambda w: aqtr.dot_general(x, w, DN, cfg).sum())(w)
