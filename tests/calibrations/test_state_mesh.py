"""Calibration state on a 2-device mesh equals the unsharded run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import aqtr
from aqtr.calibrations import Lsq, Pact

pytestmark = pytest.mark.skipif(
  jax.device_count() < 2, reason='needs 2 host devices (tests/conftest.py)'
)

DN = (((1,), (0,)), ((), ()))


def _lsq_pact():
  base = aqtr.presets.int8()
  lhs = aqtr.TensorConfig(
    numerics=base.fwd.lhs.numerics,
    calibration=Pact(init_clip=2.0),
    tiling=aqtr.tilings.PerTensor(),
  )
  rhs = aqtr.TensorConfig(numerics=base.fwd.rhs.numerics, calibration=Lsq())
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=lhs, rhs=rhs), dlhs=base.dlhs, drhs=base.drhs
  )


def _step(cfg):
  @jax.jit
  def step(x, w, s):
    def loss(w, s):
      out, new = aqtr.dot_general(x, w, DN, cfg, state=s)
      return jnp.sum(out**2), new

    (lv, new), (gw, gs) = jax.value_and_grad(loss, (0, 1), has_aux=True)(w, s)
    learned, _ = aqtr.state.split(gs)
    return lv, gw, learned, aqtr.state.merge(new, gs)

  return step


@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize('name', ['fp8_delayed', 'lsq_pact'])
def test_state_on_a_mesh_equals_one_device(axis_type, name):
  cfg = aqtr.presets.fp8_delayed(4) if name == 'fp8_delayed' else _lsq_pact()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  s = aqtr.state.init(x, w, DN, cfg)
  step = _step(cfg)
  want = step(x, w, s)
  mesh = jax.make_mesh((2,), ('data',), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P('data', None)))
    got = step(xs, w, s)
    got = step(xs, w, got[3])  # a second step from the new state
  want = step(x, w, want[3])
  jax.tree.map(np.testing.assert_array_equal, got, want)
