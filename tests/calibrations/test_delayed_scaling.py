"""Delayed scaling: the history recurrence, the backward history, scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.calibrations import DelayedScaling

DN = (((1,), (0,)), ((), ()))
L = 3


def _cfg():
  return aqtr.presets.fp8_delayed(history_length=L)


def test_bound_is_max_of_last_l_amaxes():
  c = DelayedScaling(history_length=L)
  amaxes = [2.0, 5.0, 1.0, 3.0, 0.5]
  st = c.init_state(jnp.zeros((1, 1, 1, 4)), (3,), None)
  bounds = []
  for a in amaxes:
    x = jnp.array([[[[a, -a / 2, 0.0, a / 4]]]])
    b, st = c.bound_with_state(x, (3,), None, st)
    bounds.append(float(b.squeeze()))
  # Step 0: empty history -> current amax; then max of the previous L.
  assert bounds == [2.0, 2.0, 5.0, 5.0, 5.0]
  np.testing.assert_array_equal(st['stats']['history'].ravel(), [0.5, 3, 1])
  # After L + 1 steps the bound is max(amax[1..L]).
  assert bounds[L] == max(amaxes[1 : L + 1])


def test_per_channel_history():
  c = DelayedScaling(history_length=2)
  x = jnp.array([[[[1.0, -4.0], [2.0, 0.5]]]])
  st = c.init_state(x, (3,), None)
  assert st['stats']['history'].shape == (2, 1, 1, 2, 1)
  _, st = c.bound_with_state(x, (3,), None, st)
  b, _ = c.bound_with_state(x * 0, (3,), None, st)
  np.testing.assert_array_equal(b.ravel(), [4.0, 2.0])


def _step_impl(w, s, x):
  def loss(w, s):
    out, new = aqtr.dot_general(x, w, DN, _cfg(), state=s)
    return jnp.sum(out**2), new

  (_, new), (gw, gs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, s)
  return gw, aqtr.state.merge(new, gs)


_step = jax.jit(_step_impl)


def _data(n=4):
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.standard_normal((n, 4, 8)), jnp.float32)
  xs = xs * jnp.arange(1, n + 1, dtype=jnp.float32)[:, None, None]
  w = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
  return xs, w


def test_gradient_history_updates_only_in_backward():
  xs, w = _data()
  s = aqtr.state.init(xs[0], w, DN, _cfg())
  _, new = jax.jit(lambda s: aqtr.dot_general(xs[0], w, DN, _cfg(), state=s))(s)
  # The forward call alone leaves the gradient histories untouched.
  assert float(jnp.abs(new['dlhs.lhs']['stats']['history']).max()) == 0
  np.testing.assert_allclose(
    new['fwd.lhs']['stats']['history'][0].ravel(), jnp.abs(xs[0]).max()
  )
  _, s1 = _step(w, s, xs[0])
  assert float(s1['dlhs.lhs']['stats']['history'][0].max()) > 0
  assert float(s1['drhs.lhs']['stats']['history'][0].max()) > 0
  # The forward histories come from the call's output, not the gradient.
  jax.tree.map(np.testing.assert_array_equal, s1['fwd.lhs'], new['fwd.lhs'])


def test_scan_jit_remat_equal_eager():
  xs, w = _data()
  s0 = aqtr.state.init(xs[0], w, DN, _cfg())
  s, gws = s0, []
  for x in xs:
    gw, s = _step(w, s, x)
    gws.append(gw)
  eager = (jnp.stack(gws), s)

  def body(s, x):
    gw, s = _step_impl(w, s, x)
    return s, gw

  s_scan, gw_scan = jax.jit(lambda s: jax.lax.scan(body, s, xs))(s0)
  jax.tree.map(np.testing.assert_array_equal, (gw_scan, s_scan), eager)
  hist = s_scan['fwd.lhs']['stats']['history'].ravel()
  np.testing.assert_allclose(hist, jnp.abs(xs[::-1][:L]).max(axis=(1, 2)))

  rem = jax.checkpoint(body)
  s_rem, gw_rem = jax.jit(lambda s: jax.lax.scan(rem, s, xs))(s0)
  jax.tree.map(np.testing.assert_array_equal, (gw_rem, s_rem), eager)


@pytest.mark.slow
def test_vmap_equals_loop():
  xs, w = _data(2)
  s0 = aqtr.state.init(xs[0], w, DN, _cfg())
  batched = jax.tree.map(lambda a: jnp.stack([a, a]), s0)
  gw_v, s_v = jax.jit(jax.vmap(lambda s, x: _step_impl(w, s, x)))(batched, xs)
  for i in range(2):
    gw, s = _step(w, s0, xs[i])
    np.testing.assert_array_equal(gw_v[i], gw)
    jax.tree.map(
      lambda a, b, i=i: np.testing.assert_array_equal(a[i], b), s_v, s
    )


def test_errors_name_the_operand_path():
  xs, w = _data(1)
  with pytest.raises(ValueError, match='fwd.lhs.*stateful'):
    aqtr.dot_general(xs[0], w, DN, _cfg())
  s = aqtr.state.init(xs[0], w, DN, _cfg())
  bad = dict(s)
  bad['fwd.rhs'] = {
    'stats': {'history': jnp.zeros((L + 1, 1, 1, 1, 1))},
    'learned': {},
  }
  with pytest.raises(ValueError, match='fwd.rhs.*wrong shape'):
    aqtr.dot_general(xs[0], w, DN, _cfg(), state=bad)
  del bad['fwd.rhs']
  with pytest.raises(ValueError, match="missing \\['fwd.rhs'\\]"):
    aqtr.dot_general(xs[0], w, DN, _cfg(), state=bad)


@pytest.mark.parametrize('bad', [jnp.nan, jnp.inf])
def test_non_finite_history_entries_are_ignored(bad):
  # The bound is the max of the finite entries (was: NaN dropped the whole
  # history for the current amax; inf made every output NaN).
  c = DelayedScaling(history_length=L)
  st = {'stats': {'history': jnp.array([bad, 5.0, 1.0]).reshape(L, 1, 1, 1, 1)}}
  x = jnp.array([[[[2.0, -1.0]]]])
  b, new = c.bound_with_state(x, (3,), None, st)
  assert float(b.squeeze()) == 5.0
  np.testing.assert_array_equal(new['stats']['history'].ravel(), [2, bad, 5])
  # Only non-finite entries: as an empty history, the current amax.
  empty = {'stats': {'history': jnp.full((L, 1, 1, 1, 1), bad)}}
  b, _ = c.bound_with_state(x, (3,), None, empty)
  assert float(b.squeeze()) == 2.0
  # End to end: the outputs stay finite and equal those of the clean state.
  xs, w = _data(1)
  s = aqtr.state.init(xs[0], w, DN, _cfg())
  _, s = _step(w, s, xs[0])
  dirty = jax.tree.map(lambda v: v, s)
  h = dirty['fwd.lhs']['stats']['history']
  dirty['fwd.lhs']['stats']['history'] = h.at[2].set(bad)
  run = jax.jit(lambda s: aqtr.dot_general(xs[0], w, DN, _cfg(), state=s)[0])
  out = run(dirty)
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_array_equal(out, run(s))


def test_a_non_finite_amax_makes_its_step_nan_and_enters_as_empty():
  c = DelayedScaling(history_length=L)
  st = c.init_state(jnp.zeros((1, 1, 1, 2)), (3,), None)
  _, st = c.bound_with_state(jnp.array([[[[3.0, 1.0]]]]), (3,), None, st)
  b, st = c.bound_with_state(jnp.array([[[[jnp.inf, 1.0]]]]), (3,), None, st)
  assert bool(jnp.isnan(b.squeeze()))  # this step is non-finite, like lax
  np.testing.assert_array_equal(st['stats']['history'].ravel(), [0, 3, 0])
  b, _ = c.bound_with_state(jnp.array([[[[1.0, 1.0]]]]), (3,), None, st)
  assert float(b.squeeze()) == 3.0  # the next step is not poisoned
