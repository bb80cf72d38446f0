"""Training on a device mesh: data parallel, or data x model parallel.

`Experiment.mesh` names the mesh shape: () one device, (n,) data parallel
over n devices (axis 'data'), (d, m) data x model parallel (axes 'data',
'model'). Batches are split along 'data'; with a 'model' axis every
parameter whose last axis the model axis divides is split along it (the
projections' output features), the rest replicated. The compiler
(auto axis types) places the collectives; the quantized dots compute what
they compute on one device, so losses match a single-device run up to
float summation order (XLA sums per-example reductions in an order that
depends on the per-device batch shape; an int8 rounding that flips on
such a last-bit difference moves later steps by ~1e-5 relative, as much
as computing each example alone on one device does).

On CPU, give the host several devices before JAX starts:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    aqtr-train --config=config:tiny --config='set:mesh=(2, 4)'

Several hosts: every process runs the same command with
`--config=set:distributed=True` and the coordinator given by JAX's
environment variables (see `jax.distributed.initialize`); the mesh then
spans all processes' devices.

Example:
  >>> shape_error((3,), 8)
  'mesh (3,) has 3 devices, but JAX sees 8; use a shape whose product is 8.'
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
  'AXES',
  'batch_sharding',
  'initialize_distributed',
  'make',
  'param_shardings',
  'shape_error',
  'state_shardings',
]

AXES = ('data', 'model')


def shape_error(shape: tuple[int, ...], devices: int | None = None):
  """Why `shape` is not a usable mesh shape (for `devices`), or None."""
  if len(shape) > len(AXES) or not all(
    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape
  ):
    return (
      f'mesh must be () or a tuple of 1 or 2 ints >= 1 (data[, model]), '
      f'got {shape!r}.'
    )
  if shape and devices is not None and math.prod(shape) != devices:
    return (
      f'mesh {shape!r} has {math.prod(shape)} devices, but JAX sees '
      f'{devices}; use a shape whose product is {devices}.'
    )
  return None


def make(shape: tuple[int, ...]) -> jax.sharding.Mesh:
  """The mesh of `shape` over all devices, axes 'data'[, 'model'] (auto)."""
  error = shape_error(shape, jax.device_count())
  if error or not shape:
    raise ValueError(error or 'mesh: an empty shape is one device, no mesh.')
  names = AXES[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Batches split along their leading axis over 'data'."""
  return NamedSharding(mesh, P('data'))


def param_shardings(mesh: jax.sharding.Mesh, params: Any) -> Any:
  """Per-leaf shardings: the last axis over 'model' where it divides."""
  model = dict(mesh.shape).get('model', 1)

  def one(p):
    if model > 1 and p.ndim >= 2 and p.shape[-1] % model == 0:
      return NamedSharding(mesh, P(*(None,) * (p.ndim - 1), 'model'))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, params)


def initialize_distributed() -> None:
  """Joins the multi-process job the environment describes (once).

  `jax.distributed.initialize(...)` with JAX_COORDINATOR_ADDRESS (read by
  JAX), and JAX_NUM_PROCESSES / JAX_PROCESS_ID when set (else JAX detects
  them on a cluster, e.g. SLURM or Cloud TPU). One process
  (JAX_COORDINATOR_ADDRESS=localhost:12345 JAX_NUM_PROCESSES=1
  JAX_PROCESS_ID=0) runs the same code path.
  """
  if jax.distributed.is_initialized():
    return
  kwargs = {}
  for env, arg in (
    ('JAX_NUM_PROCESSES', 'num_processes'),
    ('JAX_PROCESS_ID', 'process_id'),
  ):
    if os.environ.get(env):
      kwargs[arg] = int(os.environ[env])
  jax.distributed.initialize(**kwargs)


def state_shardings(mesh: jax.sharding.Mesh, tree: Any) -> Any:
  """Each leaf's NamedSharding on `mesh` (replicated where it has none)."""

  def one(x):
    s = getattr(x, 'sharding', None)
    if isinstance(s, NamedSharding) and s.mesh == mesh:
      return s
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree)
