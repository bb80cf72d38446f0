"""The mask schedule: dense before start_step, held between updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import sparsity
from aqtr.core import sparsify
from aqtr.core.dimension_numbers import DotLayout

LAY = DotLayout.create((2, 16), (16, 4), (((1,), (0,)), ((), ()))).rhs


def test_start_step_and_update_step():
  nm = sparsity.NM(n=2, m=4, start_step=2, update_step=3)
  t = aqtr.TensorConfig(sparsity=nm)
  step = jax.jit(
    lambda w, site: sparsify.scheduled_prune(w, t, LAY, 'kf', 'p', site)
  )
  site = sparsify.schedule_init(jnp.zeros((16, 4)))
  masks = []
  for i in range(9):
    w = jax.random.normal(jax.random.key(i), (16, 4))
    w_s, mask, site = step(w, site)
    fresh = np.asarray(nm.mask(w[None], 1)[0])
    np.testing.assert_array_equal(w_s, np.where(mask, w, 0))
    assert float(site['step']) == i + 1
    masks.append((np.asarray(mask), fresh))
  for i in (0, 1):  # before start_step: dense
    assert masks[i][0].all()
  for i in (2, 5, 8):  # update steps: made from that step's weights
    np.testing.assert_array_equal(masks[i][0], masks[i][1])
  for i in (3, 4, 6, 7):  # held from the last update
    np.testing.assert_array_equal(masks[i][0], masks[i - (i - 2) % 3][0])
    assert not (masks[i][0] == masks[i][1]).all()


def test_has_schedule():
  assert not sparsify.has_schedule(aqtr.TensorConfig())
  assert not sparsify.has_schedule(aqtr.TensorConfig(sparsity=sparsity.NM()))
  for s in (sparsity.NM(start_step=1), sparsity.Magnitude(update_step=2)):
    assert sparsify.has_schedule(aqtr.TensorConfig(sparsity=s))


def test_a_schedule_without_state_is_an_error():
  cfg = sparsity.configure(aqtr.presets.int8(), rhs=sparsity.NM(start_step=10))
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError) as e:
    aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), cfg)
  msg = str(e.value)
  assert msg.startswith('config.fwd.rhs.sparsity: NM(') and 'state' in msg
