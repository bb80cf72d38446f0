"""aqtr.state: building, splitting and merging state trees; bad input.

The engine's state is typed per slot (aqtr/core/slot_state.py); these
tests pin the user-facing tree and the errors for trees that do not
belong together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, sparsity

DN = (((1,), (0,)), ((), ()))
X, W = jnp.ones((2, 8)), jnp.ones((8, 3))


def _step(cfg, x=X, w=W):
  s = aqtr.state.init(x, w, DN, cfg)

  def loss(w, s):
    out, new = aqtr.dot_general(x, w, DN, cfg, state=s)
    return out.sum(), new

  (_, new), (_, gs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, s)
  return s, new, gs


def test_gradient_shapes_come_from_the_plan():
  s = aqtr.state.init(
    jnp.ones((4, 6, 32)), jnp.ones((32, 5)), (((2,), (0,)), ((), ())),
    aqtr.presets.fp8_delayed(history_length=3),
  )  # fmt: skip
  assert sorted(s) == ['dlhs.lhs', 'drhs.lhs', 'fwd.lhs', 'fwd.rhs']
  assert s['dlhs.lhs']['stats']['history'].shape[0] == 3
  _, new, gs = _step(aqtr.presets.fp8_delayed(history_length=3))
  merged = aqtr.state.merge(new, gs)
  assert jax.tree.structure(merged) == jax.tree.structure(new)


def test_merge_refuses_states_of_other_configs():
  _, new, _ = _step(aqtr.presets.fp8_delayed(history_length=4))
  _, _, gs_lsq = _step(aqtr.presets.int4_lsq())
  with pytest.raises(ValueError, match='different configs or calls'):
    aqtr.state.merge(new, gs_lsq)
  _, _, gs_short = _step(aqtr.presets.fp8_delayed(history_length=2))
  with pytest.raises(ValueError, match=r'dlhs\.lhs: the stats.*do not match'):
    aqtr.state.merge(new, gs_short)


def test_merge_and_split_name_a_weight_gradient():
  _, new, _ = _step(aqtr.presets.fp8_delayed(history_length=4))
  with pytest.raises(TypeError, match='gradient w.r.t. the state, not'):
    aqtr.state.merge(new, W)
  with pytest.raises(ValueError, match="'kernel' is not an operand path"):
    aqtr.state.split({'kernel': W})
  with pytest.raises(TypeError, match='got list'):
    aqtr.state.split([W])


def test_penalty_of_another_configs_state():
  lsq_state = aqtr.state.init(X, W, DN, aqtr.presets.int4_lsq())
  t = aqtr.TensorConfig(
    numerics=aqtr.numerics.IntSymmetric(bits=4),
    calibration=calibrations.Pact(),
  )
  pact = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))
  with pytest.raises(
    ValueError, match=r"fwd\.lhs: Pact\.penalty needs .*'clip'"
  ):
    aqtr.state.penalty(pact, lsq_state)


@pytest.mark.parametrize('bad', [-1.0, float('nan'), float('inf')])
def test_example_weights_must_be_finite_and_non_negative(bad):
  t = aqtr.TensorConfig(calibration=calibrations.EmaStats(example_weights=True))
  cfg = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t))
  s = aqtr.state.init(X, W, DN, cfg)
  w = np.ones(2, np.float32)
  w[1] = bad
  with pytest.raises(ValueError, match=r'fwd\.lhs: example weights must be'):
    aqtr.state.with_example_weights(s, 'fwd.lhs', w)
  aqtr.state.with_example_weights(s, 'fwd.lhs', np.full(2, 2.0))


def test_schedule_state_of_another_shape_is_named():
  nm = sparsity.NM(n=2, m=4, start_step=1)
  cfg = sparsity.configure(aqtr.presets.int8(), rhs=nm)
  w16 = jnp.ones((64, 16))
  s = aqtr.state.init(jnp.ones((2, 64)), w16, DN, cfg)
  with pytest.raises(ValueError, match=r'fwd\.rhs\.sparsity: .*\(64, 16\).*'
                     r'\(64, 8\)'):  # fmt: skip
    aqtr.dot_general(jnp.ones((2, 64)), jnp.ones((64, 8)), DN, cfg, state=s)


def test_state_from_shapes_alone_lowers_and_exports():
  cfg = aqtr.presets.fp8_delayed(history_length=4)
  xs, ws = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, W))
  s = aqtr.state.init(xs, ws, DN, cfg)
  want = aqtr.state.init(X, W, DN, cfg)
  assert jax.tree.structure(s) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  shapes = jax.eval_shape(lambda x, w: aqtr.state.init(x, w, DN, cfg), xs, ws)
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, want)

  def f(x, w, s):
    return aqtr.dot_general(x, w, DN, cfg, state=s)

  exported = jax.export.export(jax.jit(f))(xs, ws, s)
  got, new = exported.call(X, W, s)
  ref, ref_new = f(X, W, want)
  np.testing.assert_array_equal(got, ref)
  assert jax.tree.structure(new) == jax.tree.structure(ref_new)


def test_state_from_shapes_names_a_calibration_that_reads_values():
  xs = jax.ShapeDtypeStruct(X.shape, X.dtype)
  with pytest.raises(ValueError, match=r'lhs is a jax.ShapeDtypeStruct.*Lsq'):
    aqtr.state.init(xs, W, DN, aqtr.presets.int4_lsq())
