"""Safetensors files and the Hugging Face style config, read and written.

The safetensors format (the one Hugging Face's `safetensors` package
reads): 8 bytes little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, '__metadata__': {..}}
padded with spaces to a multiple of 8, then the tensors' little-endian
bytes. Reading maps the file (`np.memmap`): a tensor is copied only when
it is used. Writing goes to a temporary file in the same folder that then
replaces the path (`os.replace`): arrays read from the old file keep its
contents (truncating a mapped file in place would end them with a bus
error). bfloat16 uses `ml_dtypes`.

Example:
  >>> import numpy as np, os, tempfile
  >>> d = tempfile.mkdtemp()
  >>> f = os.path.join(d, 'm.safetensors')
  >>> write(f, {'a': np.arange(3, dtype=np.int32)})
  >>> read(f)['a'].tolist()
  [0, 1, 2]
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import ml_dtypes
import numpy as np

from aqtr.checkpoints.stored import CheckpointError

__all__ = ['CONFIG', 'WEIGHTS', 'read', 'read_config', 'write', 'write_config']

WEIGHTS = 'model.safetensors'
CONFIG = 'config.json'

_DTYPES = {
  'F64': np.dtype(np.float64),
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
  'I64': np.dtype(np.int64),
  'I32': np.dtype(np.int32),
  'I16': np.dtype(np.int16),
  'I8': np.dtype(np.int8),
  'U8': np.dtype(np.uint8),
  'BOOL': np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def write(path: str, tensors: dict, metadata: dict | None = None) -> None:
  """Writes `tensors` {name: numpy array} as one safetensors file.

  The file is written whole under a temporary name, then replaces `path`
  atomically: arrays `read` from an earlier file at `path` stay valid.
  """
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise CheckpointError(f'{name}: dtype {a.dtype} has no safetensors name.')
    a = a.astype(a.dtype.newbyteorder('<'), copy=False)
    header[name] = {
      'dtype': _NAMES[a.dtype],
      'shape': list(a.shape),
      'data_offsets': [offset, offset + a.nbytes],
    }
    offset += a.nbytes
    arrays.append(a)
  header['__metadata__'] = dict(metadata or {'format': 'pt'})
  text = json.dumps(header, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)
  tmp = f'{path}.{uuid.uuid4().hex}.tmp'
  try:
    with open(tmp, 'xb') as f:
      f.write(struct.pack('<Q', len(text)))
      f.write(text)
      for a in arrays:
        f.write(a.tobytes())
    os.replace(tmp, path)  # Live maps of the old file keep its inode.
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def read(path: str) -> dict:
  """{name: numpy array} of one safetensors file (memory-mapped)."""
  if not os.path.exists(path):
    raise CheckpointError(f'{path}: no such safetensors file.')
  with open(path, 'rb') as f:
    (n,) = struct.unpack('<Q', f.read(8))
    header = json.loads(f.read(n))
  header.pop('__metadata__', None)
  raw = np.memmap(path, np.uint8, mode='r', offset=8 + n) if header else None
  out = {}
  for name, info in header.items():
    dt = _DTYPES.get(info['dtype'])
    if dt is None:
      raise CheckpointError(
        f'{name}: unknown safetensors dtype {info["dtype"]!r} (field dtype).'
      )
    b, e = info['data_offsets']
    out[name] = raw[b:e].view(dt).reshape(info['shape'])
  return out


def write_config(folder: str, config: dict) -> None:
  with open(os.path.join(folder, CONFIG), 'w') as f:
    json.dump(config, f, indent=2, sort_keys=True)


def read_config(folder: str) -> dict:
  path = os.path.join(folder, CONFIG)
  if not os.path.exists(path):
    raise CheckpointError(f'{path}: missing (the checkpoint config).')
  with open(path) as f:
    return json.load(f)
