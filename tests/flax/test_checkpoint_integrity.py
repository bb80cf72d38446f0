"""A damaged checkpoint never restores: one CheckpointError naming its path."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax_cases import LinenMLP, digits

import aqtr
import aqtr.flax.checkpoint as ckpt
import aqtr.flax.linen as ql
from aqtr.freezers import Mode


def _tree():
  rng = np.random.default_rng(0)  # Incompressible: data dominates the files.
  return {
    'qvalue': jnp.asarray(rng.integers(-127, 128, (128, 128), np.int8)),
    'scale': jnp.asarray(rng.uniform(0.5, 1.5, 128).astype(np.float32)),
    'bias': jnp.zeros((128,), jnp.bfloat16),
  }


def _like():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _tree())


def _data_files(path: pathlib.Path) -> list[pathlib.Path]:
  """Orbax's data files (under `d/` folders), smallest first."""
  files = [f for f in path.rglob('*') if f.is_file() and f.parent.name == 'd']
  return sorted(files, key=lambda f: f.stat().st_size)


def _flip_bit(path):
  data = _data_files(path)[-1]
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))


def _truncate(path):
  for data in _data_files(path):
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _rewrite(name, content):
  def damage(path):
    if content is None:
      (path / name).unlink()
    else:
      (path / name).write_bytes(content)

  return damage


DAMAGE = {
  'one bit flipped in the data': _flip_bit,
  'truncated data': _truncate,
  'missing orbax metadata': _rewrite('_METADATA', None),
  'garbled orbax metadata': _rewrite('_METADATA', b'\xff\xfe{not json'),
  'missing checksum file': _rewrite(ckpt.CHECKSUM_FILE, None),
  'garbled checksum file': _rewrite(ckpt.CHECKSUM_FILE, b'{"format": 1'),
  'no checkpoint': lambda path: __import__('shutil').rmtree(path),
}


@pytest.mark.parametrize('damage', DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_checkpoint_raises_one_clear_error(tmp_path, damage):
  path = tmp_path / 'ckpt'
  ckpt.save(path, _tree())
  damage(path)
  with pytest.raises(ckpt.CheckpointError) as e:
    ckpt.restore(path, _like())
  message = str(e.value)
  assert message.startswith(f'{path}: ') and e.value.path == str(path)
  assert '\n' not in message and len(message) < 400


def test_intact_checkpoint_round_trips(tmp_path):
  ckpt.save(tmp_path / 'c', _tree())
  restored = ckpt.restore(tmp_path / 'c', _like())
  for key, value in _tree().items():
    np.testing.assert_array_equal(np.asarray(restored[key]), value)
    assert restored[key].dtype == value.dtype


def test_flipped_serving_checkpoint_is_refused(tmp_path):
  """The issue's case: a bit flip used to change serving output silently."""
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  x, _ = digits(16)
  v = jax.jit(LinenMLP(cfg).init)(jax.random.key(0), x)
  serving = ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x)
  ckpt.save(tmp_path / 's', serving)
  _flip_bit(tmp_path / 's')
  with pytest.raises(ckpt.CheckpointError, match='checksum mismatch|cannot'):
    ckpt.restore(tmp_path / 's', serving)
