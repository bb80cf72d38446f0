"""Small models written with stock Flax only (no aqtr): what users have.

- `Llama`: nnx decoder; RMSNorm, grouped-query attention with raw
  `jnp.einsum`, SwiGLU MLP (`nnx.Linear`), output `nnx.Einsum`; layers
  stacked with `nnx.vmap` and run by `nnx.scan` under `nnx.remat`.
- `Transformer`: linen; `nn.DenseGeneral` projections, raw einsum
  attention, `nn.scan` over `nn.remat` blocks.
- `Cnn`: linen; two `nn.Conv` and an `nn.Dense` head.
- `Moe`: nnx; router `nnx.Linear`, experts through `lax.ragged_dot`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, D, HEADS, KV, HD, FF, LAYERS, T = 32, 16, 4, 2, 4, 32, 2, 8


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm1 = nnx.RMSNorm(D, rngs=rngs)
    self.q = nnx.Linear(D, HEADS * HD, use_bias=False, rngs=rngs)
    self.kv = nnx.LinearGeneral(D, (2, KV, HD), use_bias=False, rngs=rngs)
    self.o = nnx.Einsum('bthd,hdo->bto', (HEADS, HD, D), rngs=rngs)
    self.norm2 = nnx.RMSNorm(D, rngs=rngs)
    self.gate = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(FF, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    h = self.norm1(x)
    q = self.q(h).reshape(b, t, KV, HEADS // KV, HD)
    kv = self.kv(h)
    k, v = kv[:, :, 0], kv[:, :, 1]
    s = jnp.einsum('bqkgd,bskd->bkgqs', q, k) / HD**0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(mask, s, -1e9)
    a = jnp.einsum('bkgqs,bskd->bqkgd', jax.nn.softmax(s), v)
    x = x + self.o(a.reshape(b, t, HEADS, HD))
    h = self.norm2(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
  """Per layer: 7 weight ops and 2 attention einsums; plus the head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.layers = make(rngs)
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, layer):
      return layer(x)

    x = body(x, self.layers)
    return self.head(self.norm(x))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.RMSNorm()(x)
    q, k, v = (
      nn.DenseGeneral((HEADS, HD), use_bias=False, name=n)(h)
      for n in ('q', 'k', 'v')
    )
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / HD**0.5
    a = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(s), v)
    x = x + nn.DenseGeneral(D, axis=(-2, -1), name='o')(a)
    h = nn.RMSNorm()(x)
    return x + nn.Dense(D, name='down')(
      nn.gelu(nn.Dense(FF, name='up')(h))
    ), None


class Transformer(nn.Module):
  """Per layer: 6 weight ops and 2 attention einsums; plus the head.

  `state`: the scan also carries aqtr's state collection per layer and
  splits its rng stream (what a stateful or stochastic rule needs).
  """

  state: bool = False

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, D)(ids)
    axes, rngs = {'params': 0}, {'params': True}
    if self.state:
      axes, rngs = {**axes, 'aqtr_state': 0}, {**rngs, 'aqtr': True}
    stack = nn.scan(
      nn.remat(LinenBlock),
      variable_axes=axes,
      split_rngs=rngs,
      length=LAYERS,
    )
    x, _ = stack(name='layers')(x, None)
    return nn.Dense(VOCAB, name='head')(x)


class Cnn(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class Moe(nnx.Module):
  """Top-1 routing; the experts' two matmuls are `lax.ragged_dot`s."""

  def __init__(self, experts, rngs):
    self.router = nnx.Linear(D, experts, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal()
    self.wi = nnx.Param(init(rngs.params(), (experts, D, FF)))
    self.wo = nnx.Param(init(rngs.params(), (experts, FF, D)))
    self.experts = experts

  def __call__(self, x):
    logits = self.router(x)
    e = jnp.argmax(logits, -1)
    order = jnp.argsort(e)
    sizes = jnp.bincount(e, length=self.experts).astype(jnp.int32)
    xs = x[order]
    h = jax.nn.gelu(jax.lax.ragged_dot(xs, self.wi[...], sizes))
    y = jax.lax.ragged_dot(h, self.wo[...], sizes)
    gate = jax.nn.softmax(logits)[jnp.arange(x.shape[0]), e]
    out = jnp.zeros_like(x).at[order].set(y)
    return out * gate[:, None]
