"""Where an intercepted model keeps its frozen weights: in place of the kernel.

`aqtr.flax.convert` replaces each float parameter whose ops froze it by a
holder of their frozen entries, {op key: {entry name: {'rhs': {qvalue,
scale}}}} (`aqtr.freezers.lifecycle`'s entries, one per op reading the
parameter: op key `<kind><n>_<side>`, e.g. 'einsum0_rhs'):

  nnx    a `FrozenKernel` Variable in the layer's attribute
  linen  a `FrozenBox` in the 'params' collection at the kernel's name

An op whose weight is derived from a parameter (`x @ table.T`) or whose
parameter is also read elsewhere (an embedding table looked up too) keeps
the parameter float; its frozen entries sit in the model's op store,
{op path (dots for slashes): {op key: entries}}:

  nnx    a `FrozenOps` Variable, the model's `aqtr_frozen` attribute
  linen  the variable 'ops' of the collection 'aqtr_frozen'

Holders read as zeros of the kernel's shape (the stock layer still reads its
kernel; the intercepted op ignores it in SERVE and XLA drops the zeros under
jit). Because the holder sits where the kernel sat, every transform that
moved the kernel (`nn.scan` / `nnx.scan` over stacked layers, vmap, remat,
partitioning by collection) moves the frozen values the same way: the
zeros' leading (stacked) axes are read off the values, so one holder serves
the stacked tree outside a scan and one layer's slice inside.

Example:
  >>> import jax.numpy as jnp
  >>> box = FrozenBox({'dot_general0_rhs': {'frozen_0': {'rhs': {
  ...   'qvalue': jnp.zeros((3, 4, 2), jnp.int8),
  ...   'scale': jnp.ones((3, 1, 2))}}}}, shape=(4, 2), ref_ndim=2)
  >>> box.unbox().shape  # three stacked layers
  (3, 4, 2)
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from flax.core import meta
from flax.nnx import variablelib

from aqtr.flax import intercept


def _zeros(frozen, shape, dtype, ref_ndim) -> jax.Array:
  """Zeros of `shape`, with the leading axes the frozen values carry."""
  leaves = jax.tree.leaves(frozen)
  lead = ()
  if leaves:
    q = leaves[0]
    lead = tuple(jnp.shape(q)[: jnp.ndim(q) - ref_ndim])
  return jnp.zeros(lead + tuple(shape), dtype)


class FrozenKernel(nnx.Variable):
  """nnx: the frozen entries of a parameter's ops; reads as zeros.

  Metadata `kernel_shape`, `kernel_dtype`: the kernel of one op (one layer
  of a stack); `ref_ndim`: the rank of the first frozen array per op.
  """

  def get_value(self, *, index=variablelib.MISSING):
    if not intercept.is_active() and not _SHOWING[0]:
      # Read outside a served model's call (e.g. `served.up(x)` on a
      # submodule): the zeros would be served as if they were the kernel.
      raise ValueError(
        'this parameter holds frozen serving values (int / fp8 codes and '
        'scales), not a float kernel: call the served model itself (its '
        'intercepted call serves them), not one of its submodules.'
      )
    v = _zeros(
      self.get_raw_value(),
      self.get_metadata('kernel_shape'),
      self.get_metadata('kernel_dtype'),
      self.get_metadata('ref_ndim'),
    )
    return v if index is variablelib.MISSING else v[index]

  def entries(self) -> dict:
    """{op key: {entry name: {'rhs': parts}}}."""
    return self.get_raw_value()

  # Printing a served model's state shows the holder (as the zeros it reads
  # as); only a computation reading it outside the served call is refused.
  def __nnx_repr__(self):
    with _showing():
      yield from list(super().__nnx_repr__())

  def __treescope_repr__(self, path, subtree_renderer):
    with _showing():
      return super().__treescope_repr__(path, subtree_renderer)


_SHOWING = [0]  # > 0 while a holder is being printed


@contextlib.contextmanager
def _showing():
  _SHOWING[0] += 1
  try:
    yield
  finally:
    _SHOWING[0] -= 1


class FrozenBox(struct.PyTreeNode, meta.AxisMetadata):
  """linen: the frozen entries of a parameter's ops; unboxes to zeros.

  Attributes:
    frozen: {op key: {entry name: {'rhs': parts}}}.
    shape, dtype: of the kernel of one op (one layer of a stack).
    ref_ndim: the rank of the first frozen array per op.
  """

  frozen: Any = None
  shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)
  ref_ndim: int = struct.field(pytree_node=False, default=0)

  def unbox(self) -> jax.Array:
    return _zeros(self.frozen, self.shape, self.dtype, self.ref_ndim)

  def replace_boxed(self, val):
    return val

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self

  def entries(self) -> dict:
    """{op key: {entry name: {'rhs': parts}}}."""
    return self.frozen


STORE = 'aqtr_frozen'  # the op store: nnx attribute / linen collection


class FrozenOps(nnx.Variable):
  """nnx: the op store, {op path: {op key: entries}} (see the module doc)."""


def store_key(where: str) -> str:
  """The op store's key of op path `where`."""
  return where.replace('/', '.')


def holder_entries(value) -> dict | None:
  """The entries of a FrozenKernel / FrozenBox, else None."""
  if isinstance(value, FrozenKernel | FrozenBox):
    return value.entries()
  return None


def kernel_shape(value) -> tuple:
  """The shape of one op's float kernel a holder stands for."""
  if isinstance(value, FrozenKernel):
    return tuple(value.get_metadata('kernel_shape'))
  return tuple(value.shape)


def holder_ref_ndim(value) -> int:
  """The rank of one op's first frozen array in a holder."""
  if isinstance(value, FrozenKernel):
    return value.get_metadata('ref_ndim')
  return value.ref_ndim


def holder_full_shape(value) -> tuple:
  """The shape a holder reads as (stacked axes included)."""
  if isinstance(value, FrozenKernel):
    return tuple(
      jax.eval_shape(
        lambda: _zeros(
          value.get_raw_value(),
          value.get_metadata('kernel_shape'),
          value.get_metadata('kernel_dtype'),
          value.get_metadata('ref_ndim'),
        )
      ).shape
    )
  return tuple(jax.eval_shape(value.unbox).shape)


def kernel_bytes(value) -> int:
  """Bytes of the float kernel a holder stands for (stacked axes counted)."""
  if isinstance(value, FrozenKernel):
    z = jax.eval_shape(
      lambda: _zeros(
        value.get_raw_value(),
        value.get_metadata('kernel_shape'),
        value.get_metadata('kernel_dtype'),
        value.get_metadata('ref_ndim'),
      )
    )
  else:
    z = jax.eval_shape(value.unbox)
  return z.size * jnp.dtype(z.dtype).itemsize


__all__ = [
  'STORE',
  'FrozenBox',
  'FrozenKernel',
  'FrozenOps',
  'holder_entries',
  'holder_full_shape',
  'holder_ref_ndim',
  'kernel_bytes',
  'kernel_shape',
  'store_key',
]
