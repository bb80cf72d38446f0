"""fusion_boundary on an array sharded over an explicit mesh axis.

Under `jit` with no mesh context (`jax.set_mesh`), the abstract mesh is
empty, but an array whose type is sharded along an explicit axis cannot
take the CPU while-loop fence (its trip count slices the first value,
which a sharded type refuses: a ShardingTypeError until this was fixed).
The fence is then an `optimization_barrier`, as inside a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from aqtr.core import boundary

pytestmark = pytest.mark.skipif(
  jax.device_count() < 2, reason='needs 2 host devices (tests/conftest.py)'
)


def _sharded():
  mesh = jax.make_mesh((2,), ('x',), axis_types=(AxisType.Explicit,))
  x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('x')))
  return mesh, x


def test_fusion_boundary_of_an_explicitly_sharded_array_in_a_mesh():
  mesh, x = _sharded()
  with jax.set_mesh(mesh):
    y = jax.jit(boundary.fusion_boundary)(x)
  np.testing.assert_array_equal(y, x)


def test_fusion_boundary_of_an_explicitly_sharded_array_without_a_mesh():
  _, x = _sharded()
  y = jax.jit(boundary.fusion_boundary)(x)
  np.testing.assert_array_equal(y, x)
