"""Shared fixtures of the aqtr.ptq tests: configs, sites, correlated data."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import aqtr
from aqtr.ptq.collect import Site
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel

DN = (((1,), (0,)), ((), ()))


def weight_only(numerics, tiling=None, calibration=None):
  """A weight-only config: `numerics` (and tiling) on the rhs."""
  cfg = aqtr.presets.int8_weight_only()
  kw = {'numerics': numerics, 'tiling': tiling or PerChannel()}
  if calibration is not None:
    kw['calibration'] = calibration
  rhs = dataclasses.replace(cfg.fwd.rhs, **kw)
  return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))


def configs() -> dict:
  """Every weight format the solvers must handle, by name."""
  n = aqtr.numerics
  return {
    'int8': weight_only(n.get('int_symmetric')(bits=8)),
    'int4': aqtr.presets.int4_weight_only(),
    'int3': weight_only(n.get('int_symmetric')(bits=3)),
    'int4_g32': weight_only(
      n.get('int_symmetric')(bits=4, storage='int4'), SubChannel(tile_size=32)
    ),
    'int4_asym_g32': aqtr.presets.int4_asym_weight_only(group=32),
    'nf4': weight_only(n.get('nf4')(), SubChannel(tile_size=64)),
    'fp4_e2m1': weight_only(n.get('fp')(exponent_bits=2, mantissa_bits=1)),
    'mxfp4': aqtr.presets.mxfp4_weight_only(),
    'nvfp4': aqtr.presets.nvfp4(),
  }


def site(config, d_in, d_out, tokens=8) -> Site:
  """A plain [tokens, d_in] x [d_in, d_out] weight op."""
  return Site(
    'op',
    DN,
    config,
    jax.ShapeDtypeStruct((tokens, d_in), jnp.float32),
    jax.ShapeDtypeStruct((d_in, d_out), jnp.float32),
  )


def correlated(key, tokens, d_in) -> jax.Array:
  """Activations with strongly correlated channels (a low-rank mix)."""
  k1, k2, k3 = jax.random.split(key, 3)
  base = jax.random.normal(k1, (tokens, d_in // 4))
  mix = jax.random.normal(k2, (d_in // 4, d_in))
  return base @ mix + 0.1 * jax.random.normal(k3, (tokens, d_in))
