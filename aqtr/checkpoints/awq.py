"""AutoAWQ's GEMM layout: qweight / qzeros / scales, 4 bits.

Per module M (unsigned codes u = q + 8, zero points uz = z + 8; within
each int32 word of 8 values the columns sit in AWQ's order
[0, 2, 4, 6, 1, 3, 5, 7]):

  M.qweight  int32 [d_in, d_out / 8]: u packed along d_out
  M.qzeros   int32 [groups, d_out / 8]: uz packed the same way
  M.scales   [groups, d_out]

so `w[i, o] = (u[i, o] - uz[i // group, o]) * scales[i // group, o]`, and
`quantization_config` {quant_method: 'awq', bits: 4, group_size,
zero_point: true, version: 'gemm'}. A symmetric weight is written with
uz = 8 (AWQ's kernels always read qzeros).

Example:
  >>> import numpy as np
  >>> from aqtr.checkpoints.stored import Stored
  >>> w = Stored(q=np.arange(16, dtype=np.int8).reshape(2, 8) - 8,
  ...            scale=np.ones((1, 8), np.float32), bits=4, group=2)
  >>> t, qc = Awq().encode({'fc': w})
  >>> hex(int(t['fc.qweight'][0, 0]) & 0xffffffff)
  '0x75316420'
  >>> got, _ = Awq().decode(t, qc)
  >>> bool((got['fc'].q == w.q).all())
  True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from aqtr.checkpoints.layouts import Layout, modules, need, register, shape_is
from aqtr.checkpoints.stored import CheckpointError, Stored, pack, unpack

__all__ = ['Awq']

ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # word position -> column
INVERSE = np.argsort(ORDER)  # column -> word position


def _interleave(a: np.ndarray) -> np.ndarray:
  r, c = a.shape
  return a.reshape(r, c // 8, 8)[:, :, ORDER].reshape(r, c)


def _deinterleave(a: np.ndarray) -> np.ndarray:
  r, c = a.shape
  return a.reshape(r, c // 8, 8)[:, :, INVERSE].reshape(r, c)


@register('awq')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Awq(Layout):
  """AutoAWQ GEMM (see the module docstring)."""

  quant_method = 'awq'

  def encode(self, weights):
    tensors, kinds = {}, set()
    for name, w in weights.items():
      if w.kind != 'int':
        raise CheckpointError(
          f'{name}: {w.kind} codes have no awq layout; export them with '
          "format='compressed-tensors'."
        )
      if w.g_idx is not None:
        raise CheckpointError(
          f'{name}.g_idx: act-order rows (a g_idx permutation) have no awq '
          "layout; export them with format='gptq'."
        )
      if w.bits != 4 or w.d_out % 8:
        raise CheckpointError(
          f'{name}: the awq layout holds 4-bit codes with d_out a multiple '
          f'of 8; got bits={w.bits}, d_out={w.d_out} (field bits).'
        )
      zero = np.zeros(w.scale.shape, np.int16) if w.zero is None else w.zero
      u = _interleave(w.q.astype(np.int16) + 8)
      uz = _interleave(zero.astype(np.int16) + 8)
      tensors[f'{name}.qweight'] = pack(u, 4, 1)
      tensors[f'{name}.qzeros'] = pack(uz, 4, 1)
      tensors[f'{name}.scales'] = self.scales(w.scale)
      kinds.add(-1 if w.channelwise else w.group)
    if len(kinds) > 1:
      raise CheckpointError(
        'awq: one quantization_config holds one group_size; the weights '
        f'have {sorted(kinds)} (field group_size).'
      )
    qc = {
      'quant_method': 'awq',
      'bits': 4,
      'group_size': kinds.pop() if kinds else 128,
      'zero_point': True,
      'version': 'gemm',
    }
    return tensors, qc

  def decode(self, tensors, config):
    tensors = dict(tensors)
    bits, version = config.get('bits', 4), config.get('version', 'gemm')
    if bits != 4 or str(version).lower() != 'gemm':
      raise CheckpointError(
        f'quantization_config: bits={bits!r} version={version!r}; aqtr '
        "reads AWQ's 4-bit 'gemm' layout (fields bits, version)."
      )
    group = config.get('group_size', 128)
    has_zero = bool(config.get('zero_point', True))
    found = modules(tensors, '.qweight')
    out = {}
    for m in found:
      qweight = need(tensors, f'{m}.qweight', 'the codes')
      scales = need(tensors, f'{m}.scales', 'the scales')
      d_in, d_out = qweight.shape[0], qweight.shape[1] * 8
      g = d_in if group in (-1, None, 0) else group
      if not isinstance(g, int) or g <= 0 or d_in % g:
        raise CheckpointError(
          f'{m}.scales: quantization_config.group_size={group!r} does not '
          f'divide d_in={d_in}.'
        )
      n = d_in // g
      shape_is(scales, (n, d_out), f'{m}.scales', f'group_size={group}')
      u = _deinterleave(unpack(qweight, 4, d_out, axis=1)).astype(np.int16)
      zero = None
      if has_zero:
        qzeros = need(tensors, f'{m}.qzeros', 'zero_point=true')
        shape_is(qzeros, (n, d_out // 8), f'{m}.qzeros', f'group_size={group}')
        uz = _deinterleave(unpack(qzeros, 4, d_out, axis=1)).astype(np.int16)
        zero = (uz - 8).astype(np.int8)
      out[m] = Stored(
        q=(u - 8).astype(np.int8),
        scale=np.asarray(scales),
        zero=zero,
        bits=4,
        group=g,
      )
    return out, tensors
