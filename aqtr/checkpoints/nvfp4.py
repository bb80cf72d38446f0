"""NVFP4 in compressed-tensors' `nvfp4-pack-quantized` layout.

Per module M (torch orientation, weight [d_out, d_in]):

  M.weight_packed        uint8 [d_out, d_in / 2]: E2M1 codes (sign bit 3,
                         then the magnitude code of 0, 0.5, 1, 1.5, 2, 3,
                         4, 6), two per byte along d_in, low nibble first
  M.weight_scale         float8_e4m3fn [d_out, d_in / 16]: block scales d
  M.weight_global_scale  float32 [1]: the tensor's global scale g

with config weights {num_bits: 4, type: 'float', strategy: 'tensor_group',
group_size: 16, symmetric: true, scale_dtype: float8_e4m3fn}. The
reference dequantizes `w = e2m1(q) * (d / g)`, the block's scale d / g
computed in float32 (compressed-tensors' `dequantize` with the global
scale; its `NVFP4PackedCompressor.decompress` rounds the result to
bfloat16).

aqtr keeps one float32 scale per block. Read, that scale is the
reference's float32 d / g, so aqtr's `e2m1(q) * scale` is the reference's
float32 value bit for bit (the product of a 2-bit E2M1 value and a
float32 scale is exact). Written, each block scale s must be such a
quotient: `encode` finds one global scale g with e4m3 block scales d and
f32(d / g) == s for every block, or refuses in one line. aqtr's own NVFP4
(`aqtr.numerics.NvFp4`: s = d * s_t, an e4m3 d times an 18-bit float32
tensor scale) is found with g = 1 / s_t rounded, checked block by block.

Example:
  >>> import numpy as np
  >>> from aqtr.checkpoints.stored import Stored
  >>> w = Stored(q=np.full((32, 2), 3, np.uint8), bits=4, group=16,
  ...            scale=np.array([[0.5, 0.25], [1, 2]], np.float32),
  ...            kind='nvfp4')
  >>> t = encode('fc', w)
  >>> t['fc.weight_global_scale'], t['fc.weight_scale'].astype(float).tolist()
  (array([224.], dtype=float32), [[112.0, 224.0], [56.0, 448.0]])
  >>> got = decode(t, 'fc', {'type': 'float', 'num_bits': 4,
  ...   'group_size': 16, '_group': 'group_0'})
  >>> bool((got.dequant() == w.dequant()).all())
  True
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from aqtr.checkpoints.layouts import need, shape_is
from aqtr.checkpoints.stored import CheckpointError, Stored
from aqtr.core import codecs

__all__ = ['SCALE_DTYPE', 'decode', 'encode', 'two_level']

SCALE_DTYPE = 'torch.float8_e4m3fn'  # compressed-tensors' spelling.
E4M3 = ml_dtypes.float8_e4m3fn
# The positive finite e4m3 values, largest (448) first.
_TOPS = np.arange(0x7E, 0, -1, dtype=np.uint8).view(E4M3).astype(np.float32)
_STEPS = 4  # float32 steps tried on either side of a candidate g.


def two_level(s: np.ndarray, name: str) -> tuple[np.ndarray, np.float32]:
  """(e4m3 block scales d, float32 global scale g) with f32(d / g) == s.

  Candidates: g near d_top / max(s) for each e4m3 value d_top (448
  first: the block holding the tensor's largest value), and a few float32
  steps around it; the first g whose e4m3-rounded `s * g` gives back
  every `s` exactly wins.

  Raises:
    CheckpointError: no such g (one line naming `name`).
  """
  s = np.asarray(s, np.float32)
  if not s.size or not (np.isfinite(s) & (s >= 0)).all() or s.max() <= 0:
    raise CheckpointError(
      f'{name}.weight_scale: NVFP4 block scales must be finite, >= 0 and '
      'not all 0 to be written over a global scale.'
    )
  top, s64 = np.float64(s.max()), s.astype(np.float64)
  for d_top in _TOPS:
    g0 = np.float32(np.float64(d_top) / top)
    for k in sorted(range(-_STEPS, _STEPS + 1), key=abs):
      g = _step(g0, k)
      if not np.isfinite(g) or g <= 0:
        continue
      with np.errstate(over='ignore'):
        d = (s64 * np.float64(g)).astype(E4M3)
      back = d.astype(np.float32) / g
      if np.array_equal(back, s):
        return d, g
  raise CheckpointError(
    f"{name}.weight_scale: aqtr's block scales are not e4m3 values over "
    'one float32 global scale (NVFP4 two-level scales), so the reference '
    'would dequantize other values; quantize with aqtr.numerics.NvFp4 '
    '(presets.nvfp4).'
  )


def _step(g: np.float32, k: int) -> np.float32:
  """g moved k float32 steps (k < 0: down)."""
  to = np.float32(np.inf if k > 0 else 0)
  for _ in range(abs(k)):
    g = np.nextafter(g, to, dtype=np.float32)
  return np.float32(g)


def encode(name: str, w: Stored) -> dict:
  """An 'nvfp4' Stored as the module's tensors (see the module doc)."""
  d, g = two_level(w.scale, name)
  q = jnp.asarray(np.ascontiguousarray(w.q.T.astype(np.uint8)))
  return {
    f'{name}.weight_packed': np.asarray(codecs.pack(q, 4)),
    f'{name}.weight_scale': np.ascontiguousarray(d.T),
    f'{name}.weight_global_scale': np.array([g], np.float32),
  }


def decode(tensors: dict, m: str, args: dict) -> Stored:
  """Module `m`'s NVFP4 tensors (popped from `tensors`) as a Stored."""
  where = f'config_groups.{args["_group"]}.weights'
  if (
    args.get('type') != 'float'
    or args.get('num_bits') != 4
    or args.get('group_size') != 16
    or not args.get('symmetric', True)
  ):
    raise CheckpointError(
      f'{m}.weight_packed: {where} type={args.get("type")!r} num_bits='
      f'{args.get("num_bits")!r} group_size={args.get("group_size")!r} '
      f'symmetric={args.get("symmetric", True)!r}; NVFP4 is '
      "type='float', num_bits=4, group_size=16, symmetric."
    )
  packed = np.asarray(need(tensors, f'{m}.weight_packed', 'the codes'))
  scale = np.asarray(need(tensors, f'{m}.weight_scale', 'the block scales'))
  gs = np.asarray(need(tensors, f'{m}.weight_global_scale', 'the global scale'))
  d_out, d_in = packed.shape[0], 2 * packed.shape[1]
  shape = tensors.pop(f'{m}.weight_shape', None)
  if shape is not None:
    d_out, d_in = (int(v) for v in np.asarray(shape).reshape(-1)[:2])
    shape_is(packed, (d_out, d_in // 2), f'{m}.weight_packed', 'weight_shape')
  if packed.dtype != np.uint8:
    raise CheckpointError(
      f'{m}.weight_packed: NVFP4 codes are uint8 (two E2M1 per byte), got '
      f'{packed.dtype}.'
    )
  if d_in % 16:
    raise CheckpointError(
      f'{m}.weight_packed: d_in={d_in} is not a multiple of {where}.'
      'group_size=16.'
    )
  shape_is(
    scale, (d_out, d_in // 16), f'{m}.weight_scale', f'{where}.group_size=16'
  )
  if not np.issubdtype(scale.dtype, np.floating) and scale.dtype != E4M3:
    raise CheckpointError(
      f'{m}.weight_scale: dtype {scale.dtype}; NVFP4 block scales are e4m3 '
      f'(field {where}.scale_dtype).'
    )
  if gs.size != 1:
    raise CheckpointError(
      f'{m}.weight_global_scale: shape {gs.shape}; NVFP4 has one global '
      'scale per tensor.'
    )
  q = np.asarray(codecs.unpack(jnp.asarray(packed), 4, d_in))
  # The reference's float32 block scale d / g.
  s = scale.astype(np.float32) / gs.astype(np.float32).reshape(())
  return Stored(
    q=np.ascontiguousarray(q.T),
    scale=np.ascontiguousarray(s.T),
    bits=4,
    group=16,
    kind='nvfp4',
  )
