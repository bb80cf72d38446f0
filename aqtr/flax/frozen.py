"""The one frozen container per framework: where serving values live.

Every frozen value aqtr keeps in a model, whichever way the model was
quantized (intercepted stock layers, aqtr's explicit ops, a LoRA base), is
held by one type per framework:

  nnx    `Frozen`, an nnx Variable
  linen  `FrozenBox`, an axis-metadata box in the 'params' collection

A container that stands where a float kernel sat (a *holder*) reads as
zeros of the kernel's shape: the stock layer still reads its kernel; the
quantized op ignores it in SERVE and XLA drops the zeros under jit. It
holds the frozen entries of the parameter's ops, {op key: {entry name:
{'rhs': {qvalue, scale}}}} (`aqtr.freezers.lifecycle`'s entries; op key
`<kind><n>_<side>`, e.g. 'einsum0_rhs'), or none at all when an explicit
aqtr op keeps the values itself (the kernel was *removed*). A holder may
store its entries compactly (`scale_shapes` set: scales as 8-bit codes,
QLoRA's double quantization, Dettmers et al. 2023, arXiv 2305.14314);
`entries()` hands the engine the decoded values inside the traced step,
so training and serving read the same values.

An nnx `Frozen` without a kernel's shape holds values as they are: an
explicit nnx op's frozen operands ({side: {qvalue, scale | bound}}), or
the model's op store. The op store keeps the entries of ops whose weight
is derived from a parameter (`x @ table.T`) or whose parameter is also
read elsewhere (an embedding table looked up too), {op path (dots for
slashes): {op key: entries}}: the nnx attribute `aqtr_frozen`, the linen
variable 'ops' of the collection 'aqtr_frozen'. Linen's explicit ops keep
their values in the collection 'aqtr' as plain arrays.

Because a holder sits where the kernel sat, every transform that moved the
kernel (`nn.scan` / `nnx.scan` over stacked layers, vmap, remat,
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
  >>> is_holder(box), is_removed(FrozenBox.removed((4, 2), jnp.float32))
  (True, True)
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from flax.core import meta
from flax.nnx import variablelib

from aqtr.core import codecs
from aqtr.flax import intercept

# Second-level blocks of double-quantized scales (QLoRA: 256 per block).
SCALE_CODEC = codecs.DqInt8(block=256)


def decode(stored: dict, scale_shapes: dict) -> dict:
  """Compactly stored entries -> the entries the engine reads.

  8-bit scales ('scale8', of the shapes `scale_shapes` {'<op>/<entry>':
  shape}) decode to float32; 4-bit codes stay packed (the engine decodes
  them, `aqtr.core.codecs`).
  """
  out = {}
  for op, named in stored.items():
    out[op] = {}
    for name, sides in named.items():
      parts = dict(sides['rhs'])
      if 'scale8' in parts:
        parts['scale'] = SCALE_CODEC.decode(
          parts.pop('scale8'), shape=scale_shapes[f'{op}/{name}']
        )
      out[op][name] = {'rhs': parts}
  return out


def _zeros(frozen, shape, dtype, ref_ndim) -> jax.Array:
  """Zeros of `shape`, with the leading axes the frozen values carry."""
  leaves = jax.tree.leaves(frozen)
  lead = ()
  if leaves:
    q = leaves[0]
    lead = tuple(jnp.shape(q)[: jnp.ndim(q) - ref_ndim])
  return jnp.zeros(lead + tuple(shape), dtype)


class Frozen(nnx.Variable):
  """nnx: frozen serving values; a holder of a kernel reads as zeros.

  Metadata of a holder: `kernel_shape`, `kernel_dtype` (of the kernel of
  one op, one layer of a stack), `ref_ndim` (the rank of the first frozen
  array per op), and `scale_shapes` when stored compactly. Without
  `kernel_shape` the variable holds values as they are.
  """

  @classmethod
  def holder(
    cls,
    entries: dict | None,
    *,
    shape: tuple[int, ...],
    dtype: Any,
    ref_ndim: int = 0,
    scale_shapes: tuple | None = None,
  ) -> Frozen:
    """A holder of `entries` (None: a removed kernel) standing for a
    kernel of `shape` and `dtype`."""
    meta_ = {} if scale_shapes is None else {'scale_shapes': scale_shapes}
    return cls(
      entries,
      kernel_shape=tuple(shape),
      kernel_dtype=jnp.dtype(dtype),
      ref_ndim=ref_ndim,
      **meta_,
    )

  def stands_for_kernel(self) -> bool:
    return 'kernel_shape' in self.get_metadata()

  def get_value(self, *, index=variablelib.MISSING):
    if not self.stands_for_kernel():
      return super().get_value(index=index)
    if (
      self.get_raw_value() is not None
      and not intercept.is_active()
      and not _SHOWING[0]
    ):
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

  def entries(self) -> dict | None:
    """A holder's {op key: {entry name: {'rhs': parts}}}, decoded."""
    shapes = self.get_metadata().get('scale_shapes')
    if shapes is None or self.get_raw_value() is None:
      return self.get_raw_value()
    return decode(self.get_raw_value(), dict(shapes))

  def stored(self) -> dict | None:
    """A holder's entries as stored (compact or not)."""
    return self.get_raw_value()

  # Printing a served model's state shows a holder (as the zeros it reads
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
  """linen: a holder in 'params'; unboxes to zeros of the kernel's shape.

  Attributes:
    frozen: {op key: {entry name: {'rhs': parts}}} (stored compactly when
      `scale_shapes` is set); None for a kernel an explicit op removed.
    shape, dtype: of the kernel of one op (one layer of a stack).
    ref_ndim: the rank of the first frozen array per op.
    scale_shapes: ((entry key, shape), ...) of 8-bit scales, or None.
  """

  frozen: Any = None
  shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)
  ref_ndim: int = struct.field(pytree_node=False, default=0)
  scale_shapes: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def removed(cls, shape: tuple[int, ...], dtype: Any) -> FrozenBox:
    """The stand-in of a kernel an explicit op removed."""
    return cls(None, shape=tuple(shape), dtype=jnp.dtype(dtype))

  def unbox(self) -> jax.Array:
    return _zeros(self.frozen, self.shape, self.dtype, self.ref_ndim)

  def replace_boxed(self, val):
    return val

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self

  def entries(self) -> dict | None:
    """{op key: {entry name: {'rhs': parts}}}, decoded."""
    if self.scale_shapes is None or self.frozen is None:
      return self.frozen
    return decode(self.frozen, dict(self.scale_shapes))

  def stored(self) -> dict | None:
    """The entries as stored (compact or not)."""
    return self.frozen


STORE = 'aqtr_frozen'  # the op store: nnx attribute / linen collection


def store_key(where: str) -> str:
  """The op store's key of op path `where`."""
  return where.replace('/', '.')


def _stands(value) -> bool:
  if isinstance(value, FrozenBox):
    return True
  return isinstance(value, Frozen) and value.stands_for_kernel()


def is_holder(value) -> bool:
  """Whether `value` stands for a kernel and holds its ops' entries."""
  return _stands(value) and value.stored() is not None


def is_removed(value) -> bool:
  """Whether `value` stands for a kernel whose explicit op holds the
  values (no entries of its own)."""
  return _stands(value) and value.stored() is None


def is_compact(value) -> bool:
  """Whether a holder stores its entries compactly (`compact`)."""
  if isinstance(value, FrozenBox):
    return value.scale_shapes is not None
  return is_holder(value) and 'scale_shapes' in value.get_metadata()


def holder_entries(value) -> dict | None:
  """The decoded entries of a holder, else None."""
  return value.entries() if is_holder(value) else None


def compact(value, stored: dict, scale_shapes: tuple):
  """Holder `value` (either framework) storing `stored` instead, whose
  8-bit scales have `scale_shapes`."""
  if isinstance(value, FrozenBox):
    return value.replace(frozen=stored, scale_shapes=tuple(scale_shapes))
  return Frozen.holder(
    stored,
    shape=value.get_metadata('kernel_shape'),
    dtype=value.get_metadata('kernel_dtype'),
    ref_ndim=value.get_metadata('ref_ndim'),
    scale_shapes=tuple(scale_shapes),
  )


def kernel_shape(value) -> tuple:
  """The shape of one op's float kernel a holder stands for."""
  if isinstance(value, Frozen):
    return tuple(value.get_metadata('kernel_shape'))
  return tuple(value.shape)


def kernel_dtype(value) -> Any:
  """The dtype of the float kernel a holder stands for."""
  if isinstance(value, Frozen):
    return jnp.dtype(value.get_metadata('kernel_dtype'))
  return jnp.dtype(value.dtype)


def holder_ref_ndim(value) -> int:
  """The rank of one op's first frozen array in a holder."""
  if isinstance(value, Frozen):
    return value.get_metadata('ref_ndim')
  return value.ref_ndim


def _zeros_of(value) -> jax.ShapeDtypeStruct:
  return jax.eval_shape(
    lambda: _zeros(
      value.stored(),
      kernel_shape(value),
      kernel_dtype(value),
      holder_ref_ndim(value),
    )
  )


def holder_full_shape(value) -> tuple:
  """The shape a holder reads as (stacked axes included)."""
  return tuple(_zeros_of(value).shape)


def kernel_bytes(value) -> int:
  """Bytes of the float kernel a holder stands for (stacked axes counted)."""
  z = _zeros_of(value)
  return z.size * jnp.dtype(z.dtype).itemsize


__all__ = [
  'SCALE_CODEC',
  'STORE',
  'Frozen',
  'FrozenBox',
  'compact',
  'decode',
  'holder_entries',
  'holder_full_shape',
  'holder_ref_ndim',
  'is_compact',
  'is_holder',
  'is_removed',
  'kernel_bytes',
  'kernel_dtype',
  'kernel_shape',
  'store_key',
]
