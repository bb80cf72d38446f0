"""GPTQ (arXiv 2210.17323) on the engine's grid: closed forms and checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.ptq import gptq
from aqtr.ptq.grid import Grid, quantize_fixed
from aqtr.ptq.stats import LayerStats, relative_error

from .helpers import configs, correlated, site


def _grid(name, d_in=64, d_out=16, seed=0):
  w = jax.random.normal(jax.random.key(seed), (d_in, d_out))
  return Grid.of(site(configs()[name], d_in, d_out), w)


def _solve(g, h, **kw):
  sol = gptq.solve(g.w2, h, g.scale2, g.zero2, g.numerics, **kw)
  return sol.q, sol.wq


def _reference(w2, h, scale, zero, numerics, percdamp=0.01):
  """The paper's loop, one row at a time, no lazy blocks (float64)."""
  w = np.array(w2, np.float64)
  h = np.array(h, np.float64)
  dead = np.diag(h) == 0
  h[dead, dead] = 1
  w[dead] = 0
  h += percdamp * np.mean(np.diag(h)) * np.eye(len(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  q = np.zeros_like(w)
  for i in range(len(w)):
    qi, dqi = quantize_fixed(
      numerics, jnp.asarray(w[i], jnp.float32), scale[i], zero[i]
    )
    q[i] = qi
    err = (w[i] - np.asarray(dqi, np.float64)) / u[i, i]
    w[i + 1 :] -= np.outer(u[i, i + 1 :], err)
  return q


@pytest.mark.parametrize('name', ['int4', 'int4_g32', 'nvfp4'])
def test_diagonal_h_reduces_to_round_to_nearest(name):
  g = _grid(name)
  rtn_q, rtn_w = g.quantize(g.w2)
  for h in (jnp.eye(64), jnp.diag(jnp.linspace(0.5, 3.0, 64))):
    q, wq = _solve(g, h)
    np.testing.assert_array_equal(q, rtn_q)
    np.testing.assert_array_equal(wq, rtn_w)
  assert bool((g.parts(rtn_q)['qvalue'] == g.rtn['qvalue']).all())


def test_matches_the_papers_row_loop():
  g = _grid('int4')
  x = correlated(jax.random.key(1), 256, 64)
  h = LayerStats.from_activations(x).hessian
  want = _reference(g.w2, h, g.scale2, g.zero2, g.numerics)
  for bs in (24, 128):  # 24: a padded last block
    q, _ = _solve(g, h, block_size=bs)
    assert np.mean(np.asarray(q) == want) > 0.99, bs


def test_beats_round_to_nearest_on_correlated_inputs():
  for name in ('int4', 'int3'):
    g = _grid(name, seed=3)
    s = LayerStats.from_activations(correlated(jax.random.key(2), 512, 64))
    _, wq = _solve(g, s.hessian)
    rtn = relative_error(g.quantize(g.w2)[1] - g.w2, g.w2, s.xtx)
    err = relative_error(wq - g.w2, g.w2, s.xtx)
    assert err < 0.7 * rtn, (name, err, rtn)


def test_act_order_is_the_permuted_problem_unpermuted():
  g = _grid('int4_g32', seed=4)
  x = correlated(jax.random.key(5), 256, 64) * jnp.linspace(0.1, 3, 64)[None]
  h = LayerStats.from_activations(x).hessian
  q, wq = _solve(g, h, act_order=True)
  perm = jnp.argsort(-jnp.diag(h), stable=True)
  qp, wqp, _, _ = gptq.solve(
    g.w2[perm],
    h[perm][:, perm],
    g.scale2[perm],
    g.zero2[perm],
    g.numerics,
  )
  inv = jnp.argsort(perm)
  np.testing.assert_array_equal(q, qp[inv])
  np.testing.assert_array_equal(wq, wqp[inv])
  assert not bool((q == _solve(g, h)[0]).all())


def test_dead_inputs_get_zero_rows():
  g = _grid('int4')
  x = correlated(jax.random.key(6), 128, 64).at[:, 3].set(0.0)
  q, _ = _solve(g, LayerStats.from_activations(x).hessian)
  assert bool((q[3] == 0).all())


@pytest.mark.parametrize('name', sorted(configs()))
def test_every_numerics_solves_and_round_trips_the_frozen_layout(name):
  g = _grid(name, seed=7)
  s = LayerStats.from_activations(correlated(jax.random.key(8), 256, 64))
  q, wq = _solve(g, s.hessian)
  parts = g.parts(q)
  assert {k: (v.shape, v.dtype) for k, v in parts.items()} == {
    k: (v.shape, v.dtype) for k, v in g.rtn.items()
  }
  np.testing.assert_array_equal(g.dequant(parts), wq)  # what SERVE reads
  rtn = relative_error(g.dequant(g.rtn) - g.w2, g.w2, s.xtx)
  assert relative_error(wq - g.w2, g.w2, s.xtx) < rtn


def test_dynamic_groups_refresh_the_grid_as_reached():
  g = _grid('int4_g32', seed=9)
  group, regroup = g.regroup()
  assert group == 32
  # H = I: nothing is updated, so every group's grid is RTN's.
  sol = gptq.solve(
    g.w2,
    jnp.eye(64),
    g.scale2,
    g.zero2,
    g.numerics,
    group=32,
    regroup=regroup,
  )
  np.testing.assert_array_equal(sol.scale, g.scale2)
  np.testing.assert_array_equal(sol.q, g.quantize(g.w2)[0])
  s = LayerStats.from_activations(correlated(jax.random.key(10), 256, 64))
  sol = gptq.solve(
    g.w2,
    s.hessian,
    g.scale2,
    g.zero2,
    g.numerics,
    group=32,
    regroup=regroup,
    block_size=48,  # rounded down to whole groups
  )
  np.testing.assert_array_equal(sol.scale[:32], g.scale2[:32])  # first group
  assert not bool((sol.scale[32:] == g.scale2[32:]).all())  # refreshed
  parts = g.parts(sol.q, sol.scale, sol.zero)
  np.testing.assert_array_equal(g.dequant(parts), sol.wq)  # served exactly
  rtn = relative_error(g.quantize(g.w2)[1] - g.w2, g.w2, s.xtx)
  assert relative_error(sol.wq - g.w2, g.w2, s.xtx) < rtn
  assert _grid('int4').regroup() == (0, None)  # per-channel: one group
  with pytest.raises(ValueError, match='use static_groups=True'):
    _grid('nvfp4').regroup()
  with pytest.raises(ValueError, match='needs regroup, no act_order'):
    gptq.solve(
      g.w2,
      s.hessian,
      g.scale2,
      g.zero2,
      g.numerics,
      group=32,
      regroup=regroup,
      act_order=True,
    )
