"""n_m: exactly n of every m along the contraction, through the engine."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import presets, sparsity, tilings

DN = (((1,), (0,)), ((), ()))


def _groups(a, nm: sparsity.NM, axis: int):
  """[..., G, m, block] groups of `a` along `axis` (numpy)."""
  return np.asarray(nm.groups(jnp.moveaxis(jnp.asarray(a), axis, -1)))


@pytest.mark.parametrize(
  'nm',
  [
    sparsity.NM(n=1, m=4),
    sparsity.NM(n=2, m=4),
    pytest.param(sparsity.NM(n=3, m=4), marks=pytest.mark.slow),
    sparsity.NM(n=2, m=8),
    sparsity.NM(n=2, m=4, block=2),
    sparsity.NM(n=1, m=4, offset=4),
  ],
  ids=['1:4', '2:4', '3:4', '2:8', '2:4/block2', '1:4/offset4'],
)
def test_exactly_n_nonzeros_in_every_group_along_the_contraction(nm):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 6)).astype(np.float32)  # [K, N]
  mask = np.asarray(nm.mask(jnp.asarray(w)[None], 1)[0])
  units = _groups(mask, nm, 0)  # [N, G, m, block]
  assert (units.all(-1) | ~units.any(-1)).all()  # whole units
  np.testing.assert_array_equal(units.any(-1).sum(-1), nm.n)
  # The kept units are the n largest by sum |w| in each group.
  score = _groups(np.abs(w), nm, 0).sum(-1)
  kept_min = np.where(units.any(-1), score, np.inf).min(-1)
  dropped_max = np.where(units.any(-1), -np.inf, score).max(-1)
  assert (kept_min >= dropped_max).all()


def test_offset_groups_hold_elements_offset_apart():
  nm = sparsity.NM(n=1, m=2, offset=2)
  x = jnp.array([[[1.0, 5.0, 3.0, 2.0]]])  # groups (0, 2) and (1, 3)
  assert nm.mask(x, 2).astype(int).tolist() == [[[0, 1, 1, 0]]]


@pytest.mark.parametrize(
  'preset, tiling',
  [
    (presets.int8, None),
    pytest.param(presets.fp8, None, marks=pytest.mark.slow),
    pytest.param(
      presets.int8, tilings.SubChannel(tile_size=16), marks=pytest.mark.slow
    ),
  ],
  ids=['int8', 'fp8', 'int8_subchannel'],
)
def test_composes_with_presets(preset, tiling):
  cfg = preset()
  if tiling is not None:
    cfg = dataclasses.replace(
      cfg,
      fwd=dataclasses.replace(
        cfg.fwd,
        lhs=dataclasses.replace(cfg.fwd.lhs, tiling=tiling),
        rhs=dataclasses.replace(cfg.fwd.rhs, tiling=tiling),
      ),
    )
  nm = sparsity.NM(n=2, m=4)
  sparse = sparsity.configure(cfg, rhs=nm)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  # The stored forward QTensor carries the pruned values: n of every m.
  q = aqtr.quantize_operand(w, DN, sparse)
  nonzero = np.asarray(q.dequant() != 0)
  assert (_groups(nonzero, nm, 0).sum(-1).sum(-1) <= 2).all()
  w_s = jnp.where(nm.mask(w[None], 1)[0], w, 0.0)

  @jax.jit
  def run(x, w, w_s, q):
    def loss(w, cfg):
      return jnp.sum(aqtr.dot_general(x, w, DN, cfg) ** 2)

    return (
      jax.value_and_grad(loss)(w, sparse),
      jax.value_and_grad(loss)(w_s, cfg),
      aqtr.dot_general(x, q, DN, sparse),
      aqtr.dot_general(x, w, DN, sparse),
    )

  (v, g), (v0, g0), served, trained = run(x, w, w_s, q)
  # Values and gradient: those of the dense config at the pruned weights.
  np.testing.assert_array_equal(v, v0)
  np.testing.assert_array_equal(g, g0)
  # A stored QTensor serves bit-exactly.
  np.testing.assert_array_equal(served, trained)


def test_activation_sparsity_with_multi_axis_contraction():
  nm = sparsity.NM(n=2, m=4)
  cfg = sparsity.configure(presets.int8(), lhs=nm)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32)
  dn = (((1, 2), (0, 1)), ((), ()))
  x3 = x.reshape(3, 32)  # the contraction flattened in dot order
  x_s = jnp.where(nm.mask(x3[None], 2)[0], x3, 0.0).reshape(x.shape)
  np.testing.assert_array_equal(
    aqtr.dot_general(x, w, dn, cfg),
    aqtr.dot_general(x_s, w, dn, presets.int8()),
  )
