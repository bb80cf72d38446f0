"""AutoGPTQ's layout: qweight / qzeros / scales / g_idx, int32-packed.

Per module M (b in {2, 4, 8}, p = 32 / b values per word, unsigned codes
u = q + 2^(b-1), unsigned zero points uz = z + 2^(b-1)):

  M.qweight  int32 [d_in / p, d_out]: u packed along d_in
  M.qzeros   int32 [groups, d_out / p]: packed along d_out; the original
             format ('gptq', v1) stores uz - 1, 'gptq_v2' stores uz
  M.scales   [groups, d_out]
  M.g_idx    int32 [d_in]: the group of each input row

so `w[i, o] = (u[i, o] - uz[g_idx[i], o]) * scales[g_idx[i], o]`, and
`quantization_config` {quant_method: 'gptq', bits, group_size (-1: one
group per channel), desc_act, sym, checkpoint_format}. A symmetric
weight has uz = 2^(b-1).

Act-order (desc_act=true, AutoGPTQ's default form): g_idx is a permuted
group index (row i in group g_idx[i], group_size rows per group, in any
order). It is read into `Stored.g_idx` (checked: length, range, rows per
group; one line per mismatch) and served without a float copy: the rows
sorted by group (contiguous groups) and the input gathered to match
(`aqtr.checkpoints.tree`). Exported, such a weight writes its g_idx and
desc_act=true. aqtr's own GPTQ with act-order
(`aqtr.ptq.quantize(method='gptq', act_order=True)`) keeps each group's
rows together (static groups: the order only changes which rows are
solved first), so its export has the trivial g_idx i // group_size.

Example:
  >>> import numpy as np
  >>> from aqtr.checkpoints.stored import Stored
  >>> w = Stored(q=np.full((16, 8), 2, np.int8),
  ...            scale=np.ones((2, 8), np.float32), bits=4, group=8)
  >>> t, qc = Gptq().encode({'fc': w})
  >>> t['fc.qweight'].shape, t['fc.qzeros'].shape, qc['desc_act']
  ((2, 8), (2, 1), False)
  >>> got, _ = Gptq().decode(t, qc)
  >>> bool((got['fc'].dequant() == w.dequant()).all())
  True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from aqtr.checkpoints.layouts import Layout, modules, need, register, shape_is
from aqtr.checkpoints.stored import (
  CheckpointError,
  Stored,
  check_g_idx,
  pack,
  unpack,
)

__all__ = ['Gptq']

FORMATS = ('gptq', 'gptq_v2')


@register('gptq')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Gptq(Layout):
  """AutoGPTQ's layout (see the module docstring).

  Attributes:
    checkpoint_format: 'gptq' (v1: zero points stored minus one; what
      AutoGPTQ, transformers and vLLM read) or 'gptq_v2' (GPTQModel's).
  """

  checkpoint_format: str = 'gptq'
  quant_method = 'gptq'

  def __post_init__(self):
    super().__post_init__()
    if self.checkpoint_format not in FORMATS:
      raise CheckpointError(
        f'Gptq.checkpoint_format must be one of {FORMATS}, got '
        f'{self.checkpoint_format!r}.'
      )

  @classmethod
  def from_config(cls, config):
    fmt = config.get('checkpoint_format', 'gptq')
    if fmt not in FORMATS:
      raise CheckpointError(
        f'quantization_config.checkpoint_format={fmt!r}; aqtr reads {FORMATS}.'
      )
    return cls(checkpoint_format=fmt)

  @property
  def v1(self) -> bool:
    return self.checkpoint_format == 'gptq'

  def encode(self, weights):
    tensors, kinds, act_order = {}, set(), False
    for name, w in weights.items():
      if w.kind != 'int':
        raise CheckpointError(
          f'{name}: {w.kind} codes have no gptq layout; export them with '
          "format='compressed-tensors'."
        )
      _check_bits(w.bits, name, 'bits')
      p = 32 // w.bits
      if w.d_in % p or w.d_out % p:
        raise CheckpointError(
          f'{name}: d_in={w.d_in} and d_out={w.d_out} must be multiples of '
          f'{p} to pack {w.bits}-bit codes in int32 (field bits).'
        )
      off = 2 ** (w.bits - 1)
      zero = np.full_like(w.scale, 0, np.int16) if w.zero is None else w.zero
      uz = zero.astype(np.int16) + off
      if self.v1:
        if (uz == 0).any():
          raise CheckpointError(
            f'{name}.qzeros: a zero point of 0 (unsigned) cannot be stored '
            "in checkpoint_format='gptq' (v1 stores zero - 1); export with "
            "Gptq(checkpoint_format='gptq_v2')."
          )
        uz = uz - 1
      tensors[f'{name}.qweight'] = pack(w.q.astype(np.int16) + off, w.bits, 0)
      tensors[f'{name}.qzeros'] = pack(uz, w.bits, 1)
      tensors[f'{name}.scales'] = self.scales(w.scale)
      tensors[f'{name}.g_idx'] = w.rows.astype(np.int32)
      kinds.add((w.bits, -1 if w.channelwise else w.group, w.symmetric))
      act_order = act_order or w.g_idx is not None
    if len(kinds) > 1:
      raise CheckpointError(
        'gptq: one quantization_config holds one (bits, group_size, sym); '
        f'the weights have {sorted(kinds)} (field quantization_config).'
      )
    bits, group, sym = kinds.pop() if kinds else (4, 128, True)
    qc = {
      'quant_method': 'gptq',
      'bits': bits,
      'group_size': group,
      'desc_act': act_order,
      'sym': sym,
      'true_sequential': True,
      'checkpoint_format': self.checkpoint_format,
    }
    return tensors, qc

  def decode(self, tensors, config):
    tensors = dict(tensors)
    bits = config.get('bits')
    _check_bits(bits, 'quantization_config', 'bits')
    group = config.get('group_size', -1)
    sym = bool(config.get('sym', True))
    p = 32 // bits
    found = modules(tensors, '.qweight')
    out = {}
    for m in found:
      qweight = need(tensors, f'{m}.qweight', 'the codes')
      scales = need(tensors, f'{m}.scales', 'the scales')
      qzeros = need(tensors, f'{m}.qzeros', 'the zero points')
      d_in, d_out = qweight.shape[0] * p, qweight.shape[1]
      g = d_in if group in (-1, None, 0) else group
      if not isinstance(g, int) or g <= 0 or d_in % g:
        raise CheckpointError(
          f'{m}.scales: quantization_config.group_size={group!r} does not '
          f'divide d_in={d_in} (from qweight and bits={bits}).'
        )
      n = d_in // g
      shape_is(
        scales, (n, d_out), f'{m}.scales', f'group_size={group} and bits={bits}'
      )
      shape_is(
        qzeros,
        (n, d_out // p),
        f'{m}.qzeros',
        f'group_size={group} and bits={bits}',
      )
      g_idx = _g_idx(tensors.pop(f'{m}.g_idx', None), m, d_in, g, config)
      off = 2 ** (bits - 1)
      u = unpack(qweight, bits, d_in, axis=0).astype(np.int16)
      uz = unpack(qzeros, bits, d_out, axis=1).astype(np.int16)
      if self.v1:
        uz = uz + 1
      zero = uz - off
      if sym:
        if not (zero == 0).all():
          raise CheckpointError(
            f'{m}.qzeros: quantization_config.sym=true but the zero points '
            'are not 2^(bits-1) (field sym).'
          )
        zero = None
      elif (zero > off - 1).any():
        raise CheckpointError(
          f'{m}.qzeros: a zero point exceeds {bits} bits (field '
          'checkpoint_format: v1 stores zero - 1).'
        )
      out[m] = Stored(
        q=(u - off).astype(np.int8),
        scale=np.asarray(scales),
        zero=None if zero is None else zero.astype(np.int8),
        bits=bits,
        group=g,
        g_idx=g_idx,
      )
    return out, tensors


def _g_idx(g_idx, m: str, d_in: int, group: int, config: dict):
  """A module's g_idx, checked (None when it is the trivial i // group)."""
  if g_idx is None:
    return None
  check_g_idx(g_idx, d_in, group, m)
  g_idx = np.asarray(g_idx).astype(np.int32)
  if np.array_equal(g_idx, np.arange(d_in) // group):
    return None
  if not config.get('desc_act', False):
    raise CheckpointError(
      f'{m}.g_idx: act-order rows (not in group order), but '
      'quantization_config.desc_act is false (field desc_act).'
    )
  return g_idx


def _check_bits(bits, name: str, field: str) -> None:
  if bits not in (2, 4, 8):
    raise CheckpointError(
      f'{name}: {field}={bits!r}; the gptq layout packs 2, 4 or 8 bits '
      '(3 is not supported).'
    )
