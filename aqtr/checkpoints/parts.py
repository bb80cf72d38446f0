"""One frozen kernel's holder parts <-> `Stored` codes, and their config.

The codec between aqtr's frozen values of one 2-D kernel and the
checkpoint's codes (`aqtr.checkpoints.stored.Stored`):

  to_stored(parts, shape, where)   a holder's parts (the dot's 'kf' view
                                   [1, groups, group, d_out]) -> Stored
  from_stored(w, like)             Stored (or a list: stacked layers) ->
                                   holder parts shaped like `like`
  config_for(w)                    the weight-only DotGeneralConfig whose
                                   frozen values hold `w`
  layers_of(w, where)              stacked layers, checked to share one
                                   format

Codes are int4 / int8 (signed) or uint8 (affine numerics with unsigned
storage); E2M1 codes are MXFP4 (groups of 32) or NVFP4 (groups of 16). An
act-order weight (`Stored.g_idx`) is held with its rows sorted by group
and the order as 'perm' (int32 [d_in]; serving row j is the checkpoint's
row perm[j]). `aqtr.checkpoints.tree` finds the holders of a model.

Example:
  >>> import numpy as np
  >>> w = Stored(q=np.zeros((32, 4), np.int8),
  ...            scale=np.ones((2, 4), np.float32), group=16)
  >>> cfg = config_for(w)
  >>> cfg.fwd.rhs.tiling, cfg.fwd.rhs.numerics.storage
  (SubChannel(tile_size=16, tile_count=0), 'int4')
  >>> like = {'qvalue': np.zeros((1, 2, 16, 4), np.int8),
  ...         'scale': np.zeros((1, 2, 1, 4), np.float32)}
  >>> back = to_stored(from_stored(w, like), (32, 4), 'w', bits=4)
  >>> back.group, back.q.shape
  (16, (32, 4))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import presets
from aqtr.calibrations.minmax import MinMax
from aqtr.checkpoints.stored import CheckpointError, Stored
from aqtr.core import codecs
from aqtr.core.qtensor import as_stored_in, stored_form, swapped_view
from aqtr.numerics.int_asymmetric import IntAsymmetric
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel

__all__ = ['config_for', 'from_stored', 'layers_of', 'to_stored']


def _fewest_bits(lo: int, hi: int, unsigned: bool) -> int:
  for b in range(1, 9):
    if unsigned and 0 <= lo and hi <= 2**b - 1:
      return b
    if not unsigned and -(2 ** (b - 1)) <= lo and hi <= 2 ** (b - 1) - 1:
      return b
  raise CheckpointError(f'codes span [{lo}, {hi}]: more than 8 bits.')


def to_stored(parts: dict, shape: tuple, where: str, bits=None) -> Stored:
  """A holder's parts (the 'kf' view of a [d_in, d_out] kernel) as Stored."""
  if codecs.packed_key(parts) == 'e2m1':
    return _mx_stored(parts, shape, where)
  if codecs.packed_key(parts) == 'table4':
    raise CheckpointError(
      f'{where}: codes of a codebook (nf4) have no layout here; export '
      'int or MXFP4 weights.'
    )
  parts = codecs.decode_parts(parts)  # Packed int4 codes -> int8.
  if 'scale' in parts:  # Stored [.., d_out, d_in] ('fk') -> the 'kf' view.
    parts = as_stored_in(parts, 'kf', 'kf')
  perm = parts.pop('perm', None)
  q = parts['qvalue']
  if len(shape) != 2:
    raise CheckpointError(
      f'{where}: kernel shape {shape}; the layouts store 2-D [d_in, d_out] '
      'kernels (Dense / Linear).'
    )
  d_in, d_out = shape
  if (
    q.ndim != 4
    or q.shape[0] != 1
    or q.shape[3] != d_out
    or (q.shape[1] * q.shape[2] != d_in)
  ):
    raise CheckpointError(
      f'{where}: frozen codes of shape {q.shape} are not the [1, groups, '
      f'group, d_out] view of a [{d_in}, {d_out}] kernel (stacked layers '
      'or another layout: not exportable).'
    )
  dt = jnp.dtype(q.dtype)
  if not jnp.issubdtype(dt, jnp.integer):
    raise CheckpointError(
      f'{where}: codes of dtype {dt} (float formats such as fp8, NVFP4, '
      'MXFP4 have no int layout here); export int weights.'
    )
  n, t = q.shape[1], q.shape[2]
  codes = np.asarray(jnp.asarray(q).astype(jnp.int16)).reshape(d_in, d_out)
  scale = np.broadcast_to(
    np.asarray(parts['scale'], np.float32), (1, n, 1, d_out)
  ).reshape(n, d_out)
  zp = parts.get('zero_point')
  zero = None
  if zp is not None:
    zero = np.broadcast_to(np.asarray(zp), (1, n, 1, d_out)).reshape(n, d_out)
    zero = zero.astype(np.int16)
  unsigned = dt == jnp.uint8
  vals = [codes] + ([zero] if zero is not None else [])
  lo = min(int(v.min()) for v in vals)
  hi = max(int(v.max()) for v in vals)
  b = bits or _fewest_bits(lo, hi, unsigned)
  if unsigned:
    if zero is None:
      raise CheckpointError(f'{where}: unsigned codes without a zero point.')
    codes, zero = codes - 2 ** (b - 1), zero - 2 ** (b - 1)
  g_idx = None
  if perm is not None:  # Serving row j is the checkpoint's row perm[j].
    perm = np.asarray(perm, np.int64)
    if sorted(perm.tolist()) != list(range(d_in)):
      raise CheckpointError(
        f"{where}: stored row order 'perm' is not a permutation of {d_in} rows."
      )
    codes = codes[np.argsort(perm)]
    g_idx = np.empty(d_in, np.int32)
    g_idx[perm] = np.arange(d_in) // t
    if np.array_equal(g_idx, np.arange(d_in) // t):
      g_idx = None
  return Stored(
    q=codes.astype(np.int8),
    scale=scale,
    zero=None if zero is None else zero.astype(np.int8),
    bits=b,
    group=t,
    g_idx=g_idx,
  )


def _mx_stored(parts: dict, shape: tuple, where: str) -> Stored:
  """E2M1 codes: power-of-two scales in groups of 32 (MXFP4), or NVFP4's
  two-level scales (one float32 product per block) in groups of 16."""
  packed = parts['e2m1']
  q = np.asarray(codecs.unpack(packed, 4, 2 * jnp.shape(packed)[-1]))
  d_in, d_out = shape
  n, t = q.shape[1], q.shape[2]
  scale = np.broadcast_to(
    np.asarray(parts['scale'], np.float32), (1, n, 1, d_out)
  ).reshape(n, d_out)
  m, _ = np.frexp(scale)
  kind = {16: 'nvfp4', 32: 'mxfp4'}.get(t)
  if kind is None or (kind == 'mxfp4' and not (m == 0.5).all()):
    raise CheckpointError(
      f'{where}: E2M1 codes in groups of {t} are neither MXFP4 (groups of '
      '32, power-of-two scales) nor NVFP4 (groups of 16); export those or '
      'int weights.'
    )
  return Stored(
    q=q.reshape(d_in, d_out), scale=scale, bits=4, group=t, kind=kind
  )


def config_for(w: Stored):
  """The weight-only DotGeneralConfig whose frozen values hold `w`."""
  if w.kind == 'mxfp4':
    return presets.mxfp4_weight_only()
  if w.kind == 'nvfp4':
    return presets.nvfp4_weight_only()
  if w.zero is None:
    numerics = IntSymmetric(
      bits=w.bits, storage='int4' if w.bits <= 4 else 'int8'
    )
    cal = None
  else:
    numerics = IntAsymmetric(bits=w.bits, storage='uint8', clip_gradient=False)
    cal = MinMax(po2_scale=False)
  tiling = PerChannel() if w.channelwise else SubChannel(tile_size=w.group)
  base = presets.int8_weight_only()
  fields = {'numerics': numerics, 'tiling': tiling}
  if cal is not None:
    fields['calibration'] = cal
  rhs = dataclasses.replace(base.fwd.rhs, **fields)
  return dataclasses.replace(
    base,
    fwd=dataclasses.replace(base.fwd, rhs=rhs),
    dlhs=dataclasses.replace(base.dlhs, rhs=rhs),
  )


def layers_of(w, where: str) -> list:
  """`w` (a Stored, or a list of them: stacked layers) as a list, checked
  to share one format (bits, group size, symmetry)."""
  ws = w if isinstance(w, list) else [w]
  first = ws[0]
  for i, x in enumerate(ws[1:], 1):
    if (x.kind, x.bits, x.group, x.symmetric) != (
      first.kind,
      first.bits,
      first.group,
      first.symmetric,
    ):
      raise CheckpointError(
        f'{where}[{i}]: bits={x.bits} group={x.group} symmetric='
        f'{x.symmetric}, but layer 0 has bits={first.bits} group='
        f'{first.group} symmetric={first.symmetric}; stacked layers share '
        'one format (fields bits, group_size, sym).'
      )
  return ws


def from_stored(w, like: dict) -> dict:
  """`w` (a Stored, or a list of them: stacked layers, stacked on a
  leading axis) as holder parts shaped and typed like `like`."""
  if not isinstance(w, list):
    return _from_one(w, like)
  n = jax.tree.leaves(like)[0].shape[0]
  if len(w) != n:
    raise CheckpointError(
      f'{len(w)} layers in the checkpoint, the model stacks {n}.'
    )
  one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), like)
  perm = any(x.g_idx is not None for x in w)  # Then every layer has one.
  layers = [_from_one(x, one, perm) for x in w]
  return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def _from_one(w: Stored, like: dict, perm: bool = False) -> dict:
  """`w` as holder parts shaped and typed like the skeleton's `like`
  (stored through the codec of `config_for(w)`'s numerics); an act-order
  `w` (or `perm`: always) adds its row order 'perm'."""
  numerics = config_for(w).fwd.rhs.numerics
  shape, scale_shape = codecs.stored_shape(like), like['scale'].shape
  # A skeleton stored with the contraction minor ('fk', the served int8
  # layout): the parts are built in the 'kf' view, then swapped.
  minor = stored_form(scale_shape, 'kf') == 'fk'
  if minor:
    shape = (*shape[:-2], shape[-1], shape[-2])
    scale_shape = (*scale_shape[:-2], scale_shape[-1], scale_shape[-2])
  qs = jax.ShapeDtypeStruct(shape, numerics.dtype)
  n, t, d_out = qs.shape[1], qs.shape[2], qs.shape[3]
  if (n * t, d_out) != (w.d_in, w.d_out) or t != w.group:
    raise CheckpointError(
      f'codes [{w.d_in}, {w.d_out}] in groups of {w.group} do not fit the '
      f'model view {qs.shape}.'
    )
  if w.kind in ('mxfp4', 'nvfp4'):
    scale = w.scale.astype(np.float32).reshape(like['scale'].shape)
    codes = jnp.asarray(w.q.astype(np.uint8).reshape(qs.shape))
    return {'e2m1': codecs.pack(codes, 4), 'scale': jnp.asarray(scale)}
  order = np.argsort(w.rows, kind='stable')  # Contiguous groups.
  q = w.q.astype(np.int16)[order]
  zero = None if w.zero is None else w.zero.astype(np.float32)
  if jnp.dtype(qs.dtype) == jnp.uint8:
    q = q + 2 ** (w.bits - 1)
    zero = zero + 2 ** (w.bits - 1)
  out = {
    'qvalue': jnp.asarray(q.reshape(qs.shape)).astype(qs.dtype),
    'scale': jnp.asarray(w.scale.astype(np.float32).reshape(scale_shape)),
  }
  if 'zero_point' in like:
    out['zero_point'] = jnp.asarray(zero.reshape(like['zero_point'].shape))
  if perm or w.g_idx is not None:
    out['perm'] = jnp.asarray(order.astype(np.int32))
  if minor:
    out = swapped_view(out)
  return codecs.encode_parts(out, numerics)
