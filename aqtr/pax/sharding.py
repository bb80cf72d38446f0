"""The Pax layers' gathers and reshapes under explicit mesh axes.

With explicit axis types (the default of `jax.make_mesh`) every array's
type carries its sharding, and a few ops need the output sharding said:

  lookup(table, ids)   table[ids]: ids' spec, then the table's feature spec
  split_heads(x, n)    [b, t, n*h] -> [b, t, n, h]: the feature axis's mesh
                       axis goes to the heads when it divides n, else the
                       features are gathered first
  merge_heads(x)       [b, t, n, h] -> [b, t, n*h]: the heads' mesh axis
                       goes to the features (a sharded head_dim is gathered)
  pick(logp, ids)      logp[..., ids]: a sharded class axis is gathered

Without a mesh, or with auto axes, each is the plain jnp op (same bits).

Example:
  >>> import jax.numpy as jnp
  >>> split_heads(jnp.zeros((2, 3, 8)), 4).shape
  (2, 3, 4, 2)
  >>> merge_heads(jnp.zeros((2, 3, 4, 2))).shape
  (2, 3, 8)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

__all__ = ['explicit_spec', 'lookup', 'merge_heads', 'pick', 'split_heads']


def explicit_spec(x: jax.Array) -> tuple | None:
  """`x`'s spec (one entry per axis) when its mesh has explicit axes."""
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, 'mesh', None)
  if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
    return None
  spec = tuple(sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def _devices(x: jax.Array, entry) -> int:
  """How many devices a spec entry (None, a name or names) splits over."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  shape = jax.typeof(x).sharding.mesh.shape
  return math.prod(shape[n] for n in names)


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]` along axis 0: [V, d] and [...] -> [..., d]."""
  ids_spec, table_spec = explicit_spec(ids), explicit_spec(table)
  if ids_spec is None and table_spec is None:
    return jnp.take(table, ids, axis=0)
  ids_spec = ids_spec or (None,) * ids.ndim
  feature = table_spec[-1] if table_spec else None
  return table.at[ids].get(mode='fill', out_sharding=P(*ids_spec, feature))


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """[..., n*h] -> [..., n, h] (`num_heads` = n)."""
  shape = (*x.shape[:-1], num_heads, x.shape[-1] // num_heads)
  spec = explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  *lead, feature = spec
  if num_heads % _devices(x, feature):  # Heads cannot take the split.
    x = jax.sharding.reshard(x, P(*lead, None))
    feature = None
  return jnp.reshape(x, shape, out_sharding=P(*lead, feature, None))


def merge_heads(x: jax.Array) -> jax.Array:
  """[..., n, h] -> [..., n*h]."""
  shape = (*x.shape[:-2], x.shape[-2] * x.shape[-1])
  spec = explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  *lead, heads, head_dim = spec
  if head_dim is not None:
    x = jax.sharding.reshard(x, P(*lead, heads, None))
  return jnp.reshape(x, shape, out_sharding=P(*lead, heads))


def pick(logp: jax.Array, ids: jax.Array) -> jax.Array:
  """`logp[..., ids]`: [..., C] and integer [...] -> [...]."""
  spec = explicit_spec(logp)
  if spec is not None and spec[-1] is not None:
    logp = jax.sharding.reshard(logp, P(*spec[:-1], None))
  return jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
