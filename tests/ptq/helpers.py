"""Shared fixtures of the aqtr.ptq tests: configs, sites, correlated data."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import aqtr
import aqtr.ptq as ptq
from aqtr.flax import hosts
from aqtr.flax.sites import WeightSite
from aqtr.ptq import gptq
from aqtr.ptq.grid import Grid, weight_config
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel
from aqtr.train import models

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


def site(config, d_in, d_out, tokens=8) -> WeightSite:
  """A plain [tokens, d_in] x [d_in, d_out] weight op."""
  return WeightSite(
    op_path='op',
    dimension_numbers=DN,
    config=config,
    other=jax.ShapeDtypeStruct((tokens, d_in), jnp.float32),
    weight=jax.ShapeDtypeStruct((d_in, d_out), jnp.float32),
  )


def correlated(key, tokens, d_in) -> jax.Array:
  """Activations with strongly correlated channels (a low-rank mix)."""
  k1, k2, k3 = jax.random.split(key, 3)
  base = jax.random.normal(k1, (tokens, d_in // 4))
  mix = jax.random.normal(k2, (d_in // 4, d_in))
  return base @ mix + 0.1 * jax.random.normal(k3, (tokens, d_in))


def solution(model, rules, xs, variables=None):
  """{op path: (site, grid, gptq dequantized)} solved directly."""
  if isinstance(model, nnx.Module | nn.Module):
    target = hosts.of(aqtr.flax.quantize(model, rules), variables)
  else:
    target = hosts.of(models.inject(model, rules)[0], variables)
  got = ptq.collect(target, xs)
  out = {}
  for path, site in got.sites.items():
    g = Grid.of(site, got.weights[path])
    h = got.stats[path].hessian
    sol = gptq.solve(g.w2, h, g.scale2, g.zero2, g.numerics)
    out[path] = (site, g, (sol.q, sol.wq))
  return out


def ptq_entry(site):
  """The frozen entry name of a weight op's config."""
  return aqtr.freezers.lifecycle.entry_name(weight_config(site.config))
