"""Frozen N:M sparse weights: kept values and packed indices per group."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import codecs
from aqtr.core.qtensor import from_view, to_view
from aqtr.freezers.base import Freezer, Mode, Served, register
from aqtr.sparsity.n_m import NM


def index_bits(m: int) -> int:
  """Bits per stored index of a group of m: ceil(log2 m), rounded up to 1,
  2, 4 or 8 so that whole indices pack into each byte.

  Example:
    >>> index_bits(4), index_bits(8), index_bits(2)
    (2, 4, 1)
  """
  need = max(1, (m - 1).bit_length())
  return next(b for b in (1, 2, 4, 8) if b >= need)


def _pack(idx: jax.Array, bits: int) -> jax.Array:
  """[..., L] integers < 2^bits -> [..., ceil(L * bits / 8)] uint8."""
  return codecs.pack(idx, bits)


def _unpack(packed: jax.Array, bits: int, length: int) -> jax.Array:
  """The inverse of `_pack`: [..., P] uint8 -> [..., length] int32."""
  return codecs.unpack(packed, bits, length).astype(jnp.int32)


def compress(
  q: jax.Array, nm: NM, zero: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """N:M values [..., K] -> (kept values [..., G, n, block], packed indices).

  Each group keeps its n units that differ from `zero` (the code of a
  pruned 0: 0, or the zero point of affine numerics, broadcastable to q),
  padded with units equal to `zero` where fewer differ; `decompress`
  restores the group exactly as long as at most n of its units differ,
  which pruning with `nm` guarantees. Indices (the unit's slot in its
  group, < m) are packed `index_bits(m)` bits each into uint8
  [..., ceil(G * n * bits / 8)].
  """
  g = nm.groups(q)  # [..., G, m, block]
  z = 0
  if zero is not None:
    z = nm.groups(jnp.broadcast_to(zero, q.shape).astype(q.dtype))
  nonzero = (g != z).any(-1).astype(jnp.float32)
  _, idx = lax.top_k(nonzero, nm.n)  # [..., G, n]: the non-zero slots
  values = jnp.take_along_axis(g, idx[..., None], axis=-2)
  flat = idx.reshape(*idx.shape[:-2], -1)
  return values, _pack(flat, index_bits(nm.m))


def decompress(
  values: jax.Array,
  packed: jax.Array,
  nm: NM,
  zero: jax.Array | None = None,
) -> jax.Array:
  """The inverse of `compress` (same `zero`, [..., K]): [..., K] in the
  values' dtype."""
  *lead, ng, n, _ = values.shape
  idx = _unpack(packed, index_bits(nm.m), ng * n).reshape(*lead, ng, n)
  slots = jnp.arange(nm.m).reshape((1,) * idx.ndim + (nm.m,))
  hit = idx[..., None] == slots  # [..., G, n, m]
  which = jnp.argmax(hit, axis=-2)  # [..., G, m]: the kept unit in a slot
  dense = jnp.take_along_axis(values, which[..., None], axis=-2)
  fill = jnp.zeros((), values.dtype)
  if zero is not None:
    k = ng * nm.m * values.shape[-1]
    fill = nm.groups(jnp.broadcast_to(zero, (*lead, k)).astype(values.dtype))
  return nm.ungroup(jnp.where(hit.any(-2)[..., None], dense, fill))


@register('sparse_weights')
@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseWeightsFreezer(Freezer):
  """Stores N:M sparse quantized weights compressed; serves them exactly.

  Math. CONVERT runs TRAIN's forward quantization of the pruned operand,
  `q = Q(M * x)`, and stores, per group of m units along the contraction
  (`aqtr.sparsity.NM`), the n kept units' values (`values`, the numerics'
  dtype: n/m of the dense bytes) and their slots in the group (`indices`,
  `index_bits(m)` bits each packed into uint8: 2 bits for m = 4), and the
  scale. SERVE scatters the values back to the dense `q` and passes the
  QTensor to the dot: bit-identical to TRAIN. With affine numerics
  (`int_asymmetric`) a pruned 0 is stored as the zero point z, not 0:
  units equal to z count as pruned, and SERVE fills them with z. For 2:4
  int8 weights that is 0.5 + 0.125 bytes per weight instead of 1 (Mishra
  et al. 2021, arXiv 2104.08378, store the same 2-bit metadata for sparse
  tensor cores).
  The operand's `sparsity` must be `n_m`.

  Example:
    >>> SparseWeightsFreezer().stores(Mode.CONVERT)
    ('values', 'indices', 'scale')
  """

  frozen_parts = ('values', 'indices', 'scale')
  optional_parts = ('zero_point',)
  reads_float = False

  def stores(self, mode: Mode) -> tuple[str, ...]:
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def _nm(self, call) -> NM:
    nm = call.tensor.sparsity
    if not isinstance(nm, NM):
      raise call.error(
        f'config.fwd.{call.side}.freezer is SparseWeightsFreezer but '
        f'config.fwd.{call.side}.sparsity is {nm!r}; allowed: an '
        "aqtr.sparsity.NM ('n_m')."
      )
    return nm

  def _along_k(self, x3: jax.Array, form: str) -> jax.Array:
    """[B, F, K] from the canonical form (and back: its own inverse)."""
    return x3 if form == 'fk' else jnp.swapaxes(x3, 1, 2)

  def _zero(self, z, view_shape: tuple[int, ...], form: str) -> jax.Array:
    """A view-shaped zero point as [B, F, K] (the code of a pruned 0)."""
    return self._along_k(from_view(jnp.broadcast_to(z, view_shape), form), form)

  def freeze(self, call, stats) -> dict:
    del stats
    nm = self._nm(call)
    q = call.quantize()
    q3 = self._along_k(from_view(q.qvalue, q.form), q.form)
    parts = {'scale': q.scale}
    zero = None
    if q.zero_point is not None:  # Affine numerics: a pruned 0 is z.
      parts['zero_point'] = q.zero_point
      zero = self._zero(q.zero_point, q.qvalue.shape, q.form)
    parts['values'], parts['indices'] = compress(q3, nm, zero)
    return parts

  def serve(self, call, frozen: dict) -> Served:
    nm = self._nm(call)
    values, z = frozen['values'], frozen.get('zero_point')
    zero = None
    if z is not None:
      *lead, ng, _, block = values.shape
      k3 = jax.ShapeDtypeStruct((*lead, ng * nm.m * block), values.dtype)
      view = jax.eval_shape(
        lambda a: to_view(self._along_k(a, call.form), call.form, call.tile),
        k3,
      )
      zero = self._zero(z, view.shape, call.form)
    q3 = decompress(values, frozen['indices'], nm, zero)
    qvalue = to_view(self._along_k(q3, call.form), call.form, call.tile)
    return Served(call.qtensor(qvalue, frozen['scale'], z))
