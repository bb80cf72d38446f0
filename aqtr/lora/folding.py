"""Folding adapters into a base: the dequantized base, `A B alpha / r` in
the weight's layout, and the bytes LoRA training holds.

Shared by merging on stock models (`aqtr.lora.merge`) and on Pax
templates (`aqtr.lora.pax_merge`).

Example:
  >>> Bytes(10, 20, 30, 40, 300, 60).ratio
  0.3333333333333333
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import codecs
from aqtr.flax.frozen import holder_ref_ndim
from aqtr.flax.sites import WeightSite
from aqtr.freezers import configure, lifecycle
from aqtr.lora.session import adapter_shapes

__all__ = ['Bytes', 'delta', 'dequantized']


def dequantized(holder, site: WeightSite, cfg) -> jax.Array:
  """The frozen base of `site` in float, shaped like its kernel."""
  entries = holder.entries()[site.key]
  (entry,) = entries.values()
  wcfg = configure(cfg, rhs='weights')
  parts = codecs.decode_parts(entry['rhs'], wcfg.fwd.rhs.numerics)
  ref = parts['qvalue']
  lead = ref.ndim - holder_ref_ndim(holder)

  def one(parts):
    call = lifecycle.DotCall(
      jnp.zeros(site.other.shape, site.other.dtype),
      jnp.zeros(site.weight.shape, site.weight.dtype),
      site.dimension_numbers,
      wcfg,
    )
    qt = call.operand('rhs').qtensor(
      parts['qvalue'], parts['scale'], parts.get('zero_point')
    )
    w = qt.dequant(site.weight.dtype)
    if parts.get('perm') is None:
      return w
    # Rows stored in the order perm (an act-order checkpoint's groups made
    # contiguous, `aqtr.checkpoints`): back to the kernel's own order.
    (_, (rc, *_)), _ = site.dimension_numbers
    return jnp.take(w, jnp.argsort(parts['perm']), axis=rc)

  fn = one
  for _ in range(lead):
    fn = jax.vmap(fn)
  return fn(parts)


def delta(site: WeightSite, a, b, scale: float) -> jax.Array:
  """A B * scale in the layout of the op's weight operand (lead kept)."""
  a_shape, b_shape = adapter_shapes(site, a.shape[-1])
  lead = a.shape[: a.ndim - len(a_shape)]
  cin, cout = a_shape[:-1], b_shape[1:]
  a2 = a.reshape(*lead, math.prod(cin), a_shape[-1])
  b2 = b.reshape(*lead, b_shape[0], math.prod(cout))
  d = jnp.einsum('...ir,...rj->...ij', a2, b2) * scale
  d = d.reshape(*lead, *cin, *cout)
  (_, rc), _ = site.dimension_numbers
  free = [i for i in range(len(site.weight.shape)) if i not in rc]
  perm = np.argsort([*rc, *free])
  n = len(lead)
  return d.transpose(*range(n), *(n + int(p) for p in perm))


@dataclasses.dataclass(frozen=True)
class Bytes:
  """Bytes of LoRA training vs full fine-tuning with AdamW.

  Attributes:
    adapters: trainable A, B. optimizer: AdamW's two moments of them.
    base: the frozen adapted weights as stored. other: the other params.
    full: full fine-tuning: every weight float + two AdamW moments.
    base_float: the adapted weights in float (their full-FT share).
  """

  adapters: int
  optimizer: int
  base: int
  other: int
  full: int
  base_float: int

  @property
  def total(self) -> int:
    return self.adapters + self.optimizer + self.base + self.other

  @property
  def ratio(self) -> float:
    """LoRA training bytes / full fine-tuning bytes."""
    return self.total / self.full

  @property
  def base_bits(self) -> float:
    """Bits per adapted weight as stored (32: float)."""
    return 32.0 * self.base / self.base_float
