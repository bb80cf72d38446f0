"""compressed-tensors' `pack-quantized` layout (int 1..8 bits), MXFP4
(`mxfp4-pack-quantized`, below) and NVFP4 (`nvfp4-pack-quantized`,
`aqtr.checkpoints.nvfp4`).

Per module M (torch orientation, weight [d_out, d_in]):

  M.weight_packed      int32 [d_out, ceil(d_in b / 32)]: codes + 2^(b-1),
                       densely packed along d_in (`stored.pack`)
  M.weight_scale       [d_out, groups] (channel: groups = 1)
  M.weight_zero_point  int32 [ceil(d_out b / 32), groups]: zero points +
                       2^(b-1) packed along d_out (asymmetric only)
  M.weight_shape       int64 [2] = [d_out, d_in]

and `quantization_config` {quant_method: 'compressed-tensors', format:
'pack-quantized', config_groups: {name: {targets, weights: {num_bits,
type: 'int', symmetric, strategy: 'group' | 'channel', group_size}}},
ignore, quantization_status: 'compressed'}. Dequantized, the reference
computes `(q - z) * s` in the scale's dtype: with float32 scales it is
aqtr's value bit for bit.

Example:
  >>> import numpy as np
  >>> from aqtr.checkpoints.stored import Stored
  >>> w = Stored(q=np.full((64, 2), -3, np.int8),
  ...            scale=np.ones((2, 2), np.float32), bits=4, group=32)
  >>> t, qc = CompressedTensors().encode({'fc': w})
  >>> sorted(t), t['fc.weight_packed'].shape
  (['fc.weight_packed', 'fc.weight_scale', 'fc.weight_shape'], (2, 8))
  >>> got, rest = CompressedTensors().decode(t, qc)
  >>> bool((got['fc'].q == -3).all()), rest
  (True, {})
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from aqtr.checkpoints import nvfp4
from aqtr.checkpoints.layouts import Layout, modules, need, register, shape_is
from aqtr.checkpoints.stored import CheckpointError, Stored, pack, unpack
from aqtr.core import codecs

__all__ = ['CompressedTensors']

# Stored.kind -> the compressed-tensors format of its config groups.
FORMATS = {
  'int': 'pack-quantized',
  'mxfp4': 'mxfp4-pack-quantized',
  'nvfp4': 'nvfp4-pack-quantized',
}

_SUFFIXES = (
  'weight_packed',
  'weight_scale',
  'weight_zero_point',
  'weight_shape',
)


@register('compressed_tensors')
@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressedTensors(Layout):
  """compressed-tensors `pack-quantized` (see the module docstring)."""

  quant_method = 'compressed-tensors'

  def encode(self, weights):
    tensors, groups = {}, {}
    for name, w in weights.items():
      if w.g_idx is not None:
        raise CheckpointError(
          f'{name}.weight_g_idx: act-order rows (a g_idx permutation) are '
          'not written in this layout by aqtr; export them with '
          "format='gptq'."
        )
      if w.kind in ('mxfp4', 'nvfp4'):
        enc = _encode_mx if w.kind == 'mxfp4' else nvfp4.encode
        tensors.update(enc(name, w))
        groups.setdefault((w.kind, 4, True, w.group), []).append(name)
        continue
      off = 2 ** (w.bits - 1)
      qt = (w.q.astype(np.int16) + off).T
      tensors[f'{name}.weight_packed'] = pack(qt, w.bits, axis=1)
      tensors[f'{name}.weight_scale'] = self.scales(w.scale.T)
      tensors[f'{name}.weight_shape'] = np.array([w.d_out, w.d_in], np.int64)
      if w.zero is not None:
        zt = (w.zero.astype(np.int16) + off).T
        tensors[f'{name}.weight_zero_point'] = pack(zt, w.bits, axis=0)
      key = ('int', w.bits, w.symmetric, 0 if w.channelwise else w.group)
      groups.setdefault(key, []).append(name)
    config_groups, formats = {}, set()
    for i, ((kind, bits, sym, g), targets) in enumerate(sorted(groups.items())):
      fmt = FORMATS[kind]
      formats.add(fmt)
      weights = {
        'num_bits': bits,
        'type': 'int' if kind == 'int' else 'float',
        'symmetric': sym,
        'strategy': 'group' if g else 'channel',
        'group_size': g or None,
        'dynamic': False,
        'actorder': None,
        'observer': 'minmax',
      }
      if kind == 'nvfp4':  # e4m3 block scales over a global scale.
        weights.update(strategy='tensor_group', scale_dtype=nvfp4.SCALE_DTYPE)
      config_groups[f'group_{i}'] = {
        'targets': sorted(targets),
        'weights': weights,
        'input_activations': None,
        'output_activations': None,
        'format': fmt,
      }
    qc = {
      'quant_method': self.quant_method,
      'format': formats.pop() if len(formats) == 1 else 'mixed-precision',
      'quantization_status': 'compressed',
      'config_groups': config_groups,
      'ignore': [],
      'kv_cache_scheme': None,
    }
    return tensors, qc

  def decode(self, tensors, config):
    tensors = dict(tensors)
    top = config.get('format')
    readable = (*FORMATS.values(), 'mixed-precision')
    if top not in readable:
      raise CheckpointError(
        f'quantization_config.format: {top!r} is not supported; aqtr reads '
        f'{readable}.'
      )
    groups = config.get('config_groups') or {}
    found = modules(tensors, '.weight_packed')
    out = {}
    for m in found:
      args = _scheme(groups, m)
      fmt = args.get('_format') or top
      if fmt == FORMATS['mxfp4']:
        out[m] = _decode_mx(tensors, m, args)
      elif fmt == FORMATS['nvfp4']:
        out[m] = nvfp4.decode(tensors, m, args)
      elif fmt == FORMATS['int']:
        out[m] = _decode_one(tensors, m, args)
      else:
        raise CheckpointError(
          f'{m}.weight_packed: config_groups.{args["_group"]}.format='
          f'{fmt!r} is not supported; aqtr reads {tuple(FORMATS.values())}.'
        )
    return out, tensors


def _scheme(groups: dict, module: str) -> dict:
  """The weights args of the config group whose targets match `module`."""
  for gname, g in groups.items():
    for t in g.get('targets', ()):
      hit = (
        re.fullmatch(t[3:], module) or re.search(t[3:], module)
        if t.startswith('re:')
        else t == module or module.endswith('.' + t) or t == 'Linear'
      )
      if hit:
        w = g.get('weights')
        if not isinstance(w, dict):
          raise CheckpointError(
            f'{module}: config group {gname} has no weights args (field '
            f'config_groups.{gname}.weights).'
          )
        return dict(w, _group=gname, _format=g.get('format'))
  raise CheckpointError(
    f'{module}.weight_packed: no config group targets this module (field '
    'quantization_config.config_groups.*.targets).'
  )


def _decode_one(tensors: dict, m: str, args: dict) -> Stored:
  where = f'config_groups.{args["_group"]}.weights'
  bits = args.get('num_bits')
  if args.get('type', 'int') != 'int' or not isinstance(bits, int):
    raise CheckpointError(
      f'{m}.weight_packed: {where} type={args.get("type")!r} '
      f'num_bits={bits!r}; aqtr reads int weights of 1..8 bits.'
    )
  packed = need(tensors, f'{m}.weight_packed', 'the codes')
  scale = need(tensors, f'{m}.weight_scale', 'the scales')
  shape = need(tensors, f'{m}.weight_shape', 'the weight shape')
  d_out, d_in = (int(v) for v in np.asarray(shape).reshape(-1)[:2])
  words = -(-d_in * bits // 32)
  shape_is(
    packed,
    (d_out, words),
    f'{m}.weight_packed',
    f'{where}.num_bits={bits} and weight_shape',
  )
  strategy = args.get('strategy')
  if strategy == 'channel':
    group = d_in
  elif strategy == 'group':
    group = args.get('group_size')
    if not isinstance(group, int) or group <= 0 or d_in % group:
      raise CheckpointError(
        f'{m}.weight_scale: {where}.group_size={group!r} does not divide '
        f'd_in={d_in}.'
      )
  else:
    raise CheckpointError(
      f'{m}.weight_scale: {where}.strategy={strategy!r}; aqtr reads '
      "'channel' and 'group'."
    )
  if args.get('actorder') == 'group':
    raise CheckpointError(
      f'{m}.weight_g_idx: {where}.actorder=group (a g_idx permutation) is '
      "not served by aqtr; quantize with actorder='weight' (static groups)."
    )
  shape_is(
    scale,
    (d_out, d_in // group),
    f'{m}.weight_scale',
    f'{where}.strategy={strategy} group_size={group}',
  )
  off = 2 ** (bits - 1)
  q = unpack(packed, bits, d_in, axis=1).astype(np.int16) - off
  zero = None
  if not args.get('symmetric', True):
    zp = need(tensors, f'{m}.weight_zero_point', f'{where}.symmetric=false')
    shape_is(
      zp,
      (-(-d_out * bits // 32), d_in // group),
      f'{m}.weight_zero_point',
      f'{where}.num_bits={bits}',
    )
    zero = (unpack(zp, bits, d_out, axis=0).astype(np.int16) - off).T
    zero = zero.astype(np.int8)
  elif f'{m}.weight_zero_point' in tensors:
    tensors.pop(f'{m}.weight_zero_point')
  w = Stored(
    q=np.ascontiguousarray(q.T.astype(np.int8)),
    scale=np.ascontiguousarray(np.asarray(scale).T),
    zero=None if zero is None else np.ascontiguousarray(zero),
    bits=bits,
    group=group,
  )
  return w


def _encode_mx(name: str, w: Stored) -> dict:
  """MXFP4 (`mxfp4-pack-quantized`): E2M1 codes two per uint8 along d_in
  (low nibble first) as `weight_packed` [d_out, d_in / 2], E8M0 scales
  (the biased exponent byte) as `weight_scale` [d_out, d_in / 32]; no
  `weight_shape` (compressed-tensors writes none for this format)."""
  q = jnp.asarray(np.ascontiguousarray(w.q.T.astype(np.uint8)))
  e8m0 = w.scale.astype(np.float32).T.astype(ml_dtypes.float8_e8m0fnu)
  return {
    f'{name}.weight_packed': np.asarray(codecs.pack(q, 4)),
    f'{name}.weight_scale': np.ascontiguousarray(e8m0).view(np.uint8),
  }


def _decode_mx(tensors: dict, m: str, args: dict) -> Stored:
  where = f'config_groups.{args["_group"]}.weights'
  if (
    args.get('type') != 'float'
    or args.get('num_bits') != 4
    or args.get('group_size') != 32
  ):
    raise CheckpointError(
      f'{m}.weight_packed: {where} type={args.get("type")!r} num_bits='
      f'{args.get("num_bits")!r} group_size={args.get("group_size")!r}; '
      "MXFP4 is type='float', num_bits=4, group_size=32."
    )
  packed = need(tensors, f'{m}.weight_packed', 'the codes')
  scale = need(tensors, f'{m}.weight_scale', 'the scales')
  d_out, d_in = packed.shape[0], 2 * packed.shape[1]
  shape = tensors.pop(f'{m}.weight_shape', None)  # compressed-tensors: none
  if shape is not None:
    d_out, d_in = (int(v) for v in np.asarray(shape).reshape(-1)[:2])
    shape_is(packed, (d_out, d_in // 2), f'{m}.weight_packed', 'weight_shape')
  shape_is(
    scale, (d_out, d_in // 32), f'{m}.weight_scale', f'{where}.group_size=32'
  )
  p = np.asarray(packed)
  if p.dtype != np.uint8 or np.asarray(scale).dtype != np.uint8:
    raise CheckpointError(
      f'{m}.weight_packed: MXFP4 codes and E8M0 scales are uint8, got '
      f'{p.dtype} and {np.asarray(scale).dtype} (field {where}.scale_dtype).'
    )
  q = np.asarray(codecs.unpack(jnp.asarray(p), 4, d_in))
  e8m0 = np.ascontiguousarray(scale).view(ml_dtypes.float8_e8m0fnu)
  s = e8m0.astype(np.float32)
  return Stored(
    q=np.ascontiguousarray(q.T),
    scale=np.ascontiguousarray(s.astype(np.float32).T),
    bits=4,
    group=32,
    kind='mxfp4',
  )
