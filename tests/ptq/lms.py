"""Small LMs of the project for the fold / AWQ / SmoothQuant tests."""

from __future__ import annotations

import functools

import fiddle as fdl
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.pax import templates
from aqtr.train.stock_lm import StockLm

VOCAB, T = 32, 8


def ids(seed: int = 0, batch: int = 2) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, T), 0, VOCAB)


@functools.cache
def stock(kv_heads: int = 2) -> StockLm:
  """A one-block StockLm, d_model 16, 4 query heads (GQA when kv < 4).

  Cached: tests must not modify it (`stock_with` makes copies).
  """
  return StockLm(
    vocab_size=VOCAB,
    d_model=16,
    num_layers=1,
    num_heads=4,
    kv_heads=kv_heads,
    mlp_ratio=2,
    rngs=nnx.Rngs(0),
  )


def stock_params(model: StockLm) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def stock_with(model: StockLm, params: dict) -> StockLm:
  """A copy of `model` holding `params` (a pure dict)."""
  m = nnx.clone(model)
  state = nnx.state(m, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(m, state)
  return m


def pax_template(gated: bool = False, norm: str = 'layer') -> fdl.Config:
  return templates.transformer_lm(
    vocab_size=VOCAB,
    d_model=16,
    num_layers=1,
    num_heads=2,
    hidden_dim=32,
    max_len=T,
    tied=False,
    gated=gated,
    norm_kind=norm,
  )


@functools.cache
def pax(gated: bool = False, norm: str = 'layer'):
  """(template, module, variables) of a one-layer Pax LM."""
  t = pax_template(gated, norm)
  module = fdl.build(t)
  variables = module.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))
  # Nonzero norm biases, so folding them is exercised.
  variables = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.1 if 'norm' in jax.tree_util.keystr(p) else x,
    variables,
  )
  return t, module, variables
