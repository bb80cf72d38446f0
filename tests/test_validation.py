"""aqtr.validation.check_shapes agrees with the engine and names the path."""

import jax
import jax.numpy as jnp
import pytest

import aqtr
from aqtr import fiddlers
from aqtr.validation import check_shapes

DN = (((1,), (0,)), ((), ()))


def _step(config, lhs, rhs):
  def f(x, w):
    return aqtr.dot_general(x, w, DN, config).sum()

  return jax.grad(f, (0, 1))(jnp.ones(lhs), jnp.ones(rhs))


def _cfg(path, **tile):
  cfg = aqtr.fiddle.config('int8')
  fiddlers.use_tiling(cfg, path, 'subchannel', **tile)
  return cfg


@pytest.mark.parametrize(
  'path, k',
  [(r'fwd\..*', 96), (r'dlhs\.lhs', 40), (r'drhs\.lhs', 24)],
)
def test_tile_must_divide_each_pass_contraction(path, k):
  cfg = _cfg(path, tile_size=16)
  lhs, rhs = (24, 96), (96, 40)  # fwd contracts 96, dlhs 40, drhs 24
  where = path.replace('\\', '').split('.')[0]
  if k % 16:
    with pytest.raises(ValueError, match=rf'{where}\.lhs\.tiling: .*{k}'):
      check_shapes(cfg, lhs, rhs, DN)
    with pytest.raises(ValueError, match='does not divide'):
      _step(aqtr.fiddle.build(cfg), lhs, rhs)
  else:
    check_shapes(cfg, lhs, rhs, DN)


def test_fitting_tiles_pass_and_run():
  cfg = _cfg(r'.*\.lhs', tile_count=4)
  built = aqtr.fiddle.build(cfg)
  check_shapes(built, (8, 32), (32, 16), DN)
  _step(built, (8, 32), (32, 16))


def test_different_tiles_on_one_pass():
  cfg = _cfg(r'fwd\.lhs', tile_size=8)
  fiddlers.use_tiling(cfg, r'fwd\.rhs', 'subchannel', tile_size=16)
  with pytest.raises(ValueError, match='fwd.lhs.tiling and fwd.rhs.tiling'):
    check_shapes(cfg, (8, 32), (32, 16), DN)
