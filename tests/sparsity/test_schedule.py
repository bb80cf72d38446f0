"""The mask schedule: dense before start_step, held between updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import sparsity
from aqtr.core import slot_state, sparsify
from aqtr.core.dimension_numbers import DotLayout

LAY = DotLayout.create((2, 16), (16, 4), (((1,), (0,)), ((), ()))).rhs


def test_start_step_and_update_step():
  nm = sparsity.NM(n=2, m=4, start_step=2, update_step=3)
  t = aqtr.TensorConfig(sparsity=nm)
  step = jax.jit(
    lambda w, site: sparsify.scheduled_prune(w, t, LAY, 'kf', 'p', site)
  )
  site = slot_state.schedule_init(jnp.zeros((16, 4)))
  masks = []
  for i in range(9):
    w = jax.random.normal(jax.random.key(i), (16, 4))
    w_s, mask, site = step(w, site)
    fresh = np.asarray(nm.mask(w[None], 1)[0])
    np.testing.assert_array_equal(w_s, np.where(mask, w, 0))
    assert float(site.step) == i + 1
    masks.append((np.asarray(mask), fresh))
  for i in (0, 1):  # before start_step: dense
    assert masks[i][0].all()
  for i in (2, 5, 8):  # update steps: made from that step's weights
    np.testing.assert_array_equal(masks[i][0], masks[i][1])
  for i in (3, 4, 6, 7):  # held from the last update
    np.testing.assert_array_equal(masks[i][0], masks[i - (i - 2) % 3][0])
    assert not (masks[i][0] == masks[i][1]).all()


def test_has_schedule():
  assert not slot_state.has_schedule(aqtr.TensorConfig())
  assert not slot_state.has_schedule(aqtr.TensorConfig(sparsity=sparsity.NM()))
  for s in (sparsity.NM(start_step=1), sparsity.Magnitude(update_step=2)):
    assert slot_state.has_schedule(aqtr.TensorConfig(sparsity=s))


def test_a_schedule_without_state_is_an_error():
  cfg = sparsity.configure(aqtr.presets.int8(), rhs=sparsity.NM(start_step=10))
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError) as e:
    aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), cfg)
  msg = str(e.value)
  assert msg.startswith('config.fwd.rhs.sparsity: NM(') and 'state' in msg


def test_engine_holds_the_mask_in_the_state_tree():
  nm = sparsity.NM(n=2, m=4, start_step=1, update_step=2)
  cfg = sparsity.configure(aqtr.presets.int8(), rhs=nm)
  dn = (((1,), (0,)), ((), ()))
  x = jax.random.normal(jax.random.key(9), (4, 16))
  ws = [jax.random.normal(jax.random.key(i), (16, 8)) for i in range(5)]
  state = aqtr.state.init(x, ws[0], dn, cfg)
  assert set(state) == {'fwd.rhs.sparsity'}

  @jax.jit
  def step(w, state):
    def loss(w, state):
      out, new = aqtr.dot_general(x, w, dn, cfg, state=state)
      return jnp.sum(out * out), (out, new)

    (_, (out, new)), (dw, ds) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      w, state
    )
    return out, dw, aqtr.state.merge(new, ds)

  mask = None
  for i, w in enumerate(ws):
    out, dw, state = step(w, state)
    if i == 0:
      want = np.ones(w.shape, bool)  # before start_step: dense
    elif i % 2 == 1:
      want = np.asarray(nm.mask(w[None], 1)[0])  # update steps 1, 3
    else:
      want = mask  # held
    mask = want
    got = np.asarray(state['fwd.rhs.sparsity']['stats']['mask']) > 0.5
    np.testing.assert_array_equal(got, want)
    w_s = jnp.where(want, w, 0.0)
    np.testing.assert_array_equal(
      out, aqtr.dot_general(x, w_s, dn, aqtr.presets.int8())
    )
    # Straight-through: the dense weight gets the pruned weight's gradient.
    ref = jax.grad(
      lambda w: jnp.sum(aqtr.dot_general(x, w, dn, aqtr.presets.int8()) ** 2)
    )(w_s)
    np.testing.assert_allclose(dw, ref, rtol=1e-6, atol=1e-6)
