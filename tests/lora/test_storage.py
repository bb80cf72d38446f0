"""Compact LoRA base storage: 4-bit nf4 codes and 8-bit scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import codecs
from aqtr.lora import storage
from aqtr.numerics import Nf4


def test_nf4_codes_round_trip_exactly_with_stacked_axes():
  t = Nf4.table
  q = jnp.asarray(
    np.random.default_rng(0).choice(t, (3, 1, 2, 64, 8)), jnp.float32
  )
  entries = {
    'op': {'e': {'rhs': {'qvalue': q, 'scale': jnp.ones((3, 1, 2, 1, 8))}}}
  }
  stored, shapes = storage.encode(entries, t, False, ref_ndim=4)
  codes = stored['op']['e']['rhs']['table4']  # Two 4-bit codes per byte.
  assert codes.dtype == jnp.uint8 and codes.shape == (3, 1, 2, 64, 4)
  back = storage.decode(stored, shapes)['op']['e']['rhs']
  np.testing.assert_array_equal(codecs.decode_parts(back, Nf4())['qvalue'], q)


def test_double_quant_error_and_layout():
  s = jax.random.uniform(jax.random.key(0), (2, 3, 200), minval=0.1, maxval=2)
  packed = storage.encode_scale(s, lead=1)
  assert packed['q'].shape == (2, 3, 256) and packed['q'].dtype == jnp.int8
  assert packed['c'].shape == (2, 3) and packed['m'].shape == (2,)
  back = storage.decode_scale(packed, (3, 200))
  assert back.shape == s.shape
  # 8 bits over a block of 256 centred scales: error <= c / 254.
  c = np.asarray(packed['c']).repeat(256, -1)[:, :600]
  err = np.abs(np.asarray(back - s)).reshape(2, 600)
  assert (err <= c / 254 + 1e-6).all()
  # Slicing one layer (a scan step) decodes that layer.
  one = jax.tree.map(lambda a: a[1], packed)
  np.testing.assert_array_equal(storage.decode_scale(one, (3, 200)), back[1])
