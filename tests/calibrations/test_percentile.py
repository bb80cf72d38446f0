"""Tests of aqtr.calibrations.Percentile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr import calibrations
from aqtr.calibrations import Percentile
from calibrations import everywhere


@pytest.mark.parametrize('method', ['sort', 'top_k'])
def test_hand_computed_percentiles(method):
  x = jnp.array([[4.0, -1.0, 3.0, -2.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
  # |x| sorted: 1 2 3 4 5; h = q/100 * 4.
  for q, want in ((50.0, 3.0), (90.0, 4.6), (100.0, 5.0), (10.0, 1.4)):
    b = Percentile(q=q, method=method).calibrate(x, (1,))
    np.testing.assert_allclose(b.ravel(), [want, 0.0], rtol=1e-6)


def test_exact_methods_equal_numpy_over_several_axes():
  x = np.random.default_rng(0).standard_normal((3, 4, 50)).astype(np.float32)
  want = np.percentile(np.abs(x).transpose(1, 0, 2).reshape(4, -1), 99.0, 1)
  for method in ('sort', 'top_k'):
    b = Percentile(q=99.0, method=method).calibrate(jnp.asarray(x), (0, 2))
    assert b.shape == (1, 4, 1)
    np.testing.assert_allclose(b.ravel(), want, rtol=1e-6)


@pytest.mark.parametrize('q', [99.9, 50.0, 0.5, 100.0])
def test_histogram_over_estimates_by_at_most_one_bin(q):
  x = np.random.default_rng(1).standard_normal((6, 1000)).astype(np.float32)
  exact = np.percentile(np.abs(x), q, axis=1)
  b = Percentile(q=q, method='histogram', bins=256).calibrate(x, (1,))
  width = np.abs(x).max(axis=1) / 256
  err = np.asarray(b).ravel() - exact
  assert (err >= -1e-6).all() and (err <= width * (1 + 1e-5)).all(), err


def test_clips_outliers_that_absmax_would_keep():
  x = jnp.concatenate([jnp.linspace(-1.0, 1.0, 999), jnp.array([100.0])])
  b = Percentile(q=99.0).calibrate(x[None], (1,))
  np.testing.assert_allclose(b, [[np.percentile(np.abs(x), 99.0)]], rtol=1e-6)
  assert 0.98 < float(b[0, 0]) < 1.0


def test_per_tensor_channel_tile_jit_vmap():
  everywhere.check_groups(
    Percentile(q=90.0), lambda g: np.percentile(np.abs(g), 90.0, axis=1)
  )


def test_all_three_passes():
  everywhere.check_passes(Percentile(q=99.0))


def test_vmap_matches_a_loop():
  x = np.random.default_rng(2).standard_normal((3, 5, 40)).astype(np.float32)

  @jax.jit
  def run(x):
    out = []
    for method in ('top_k', 'histogram'):
      c = Percentile(q=95.0, method=method)
      out.append(jax.vmap(lambda xi, c=c: c.calibrate(xi, (1,)))(x))
      out.append(jnp.stack([c.calibrate(xi, (1,)) for xi in x]))
    return out

  out = run(jnp.asarray(x))
  for i in (0, 2):
    np.testing.assert_allclose(out[i], out[i + 1], rtol=1e-6)


def test_registered_as_percentile():
  assert calibrations.get('percentile') is Percentile
