"""KV caches by rule on stock models: bytes per token and quality change.

Two stock models decode greedily through their own loops, their caches
stored as `aqtr.flax.kv_cache.CacheRule(numerics=...)` says:

  linen  a Hugging Face Flax style LM (a 'cache' collection with
         cached_key / cached_value [b, S, n, h] and cache_index, written
         at cache_index), prefill then one token a step
  nnx    an LM of `nnx.MultiHeadAttention(decode=True)` layers (nnx.Cache
         variables), one token a step

Random weights (d_model 256, 4 heads of 64, 2 layers, vocabulary 256,
128 slots), a 16-token prompt, `--new` greedy tokens. Columns: cache bytes
per token (all layers, keys and values, scales included) and its ratio to
the float32 cache; fed the float cache's greedy tokens (teacher forced),
the largest logit change over the decoded steps relative to the largest
float logit, and the share of steps whose top-1 token is the float's; and
decoding freely, the share of greedy tokens equal to the float cache's
(a random model's logits are nearly flat, so one near-tie flips a token
and changes every later input: a strict measure).

Rows per model: float, int8, fp8 and int4 caches with one scale per token
and head, then int8 and int4 with one scale per head and block of
`--blocks` slots (`CacheRule(block=B)`).

Run: python benchmarks/kv_cache_rules.py [--new 32] [--blocks 32 64]
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

import flax.linen as nn
import host
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from aqtr.flax.kv_cache import CacheRule, cache_bytes, quantize_cache

D, HEADS, LEN, VOCAB, LAYERS = 256, 4, 128, 256, 2


class Attention(nn.Module):
  """HF Flax style attention with a 'cache' collection."""

  @nn.compact
  def __call__(self, x, init_cache: bool = False):
    t = x.shape[1]
    h = D // HEADS

    def proj(name):
      return nn.DenseGeneral((HEADS, h), name=name)

    q, k, v = proj('q')(x), proj('k')(x), proj('v')(x)
    decoding = self.has_variable('cache', 'cached_key')
    ck = self.variable('cache', 'cached_key', jnp.zeros, k.shape, k.dtype)
    cv = self.variable('cache', 'cached_value', jnp.zeros, v.shape, v.dtype)
    ci = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    queries = jnp.arange(t)
    if decoding:
      i = ci.value
      ck.value = lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
      cv.value = lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
      ci.value = i + t
      k, v, queries = ck.value, cv.value, i + queries
    mask = jnp.arange(k.shape[1])[None] <= queries[:, None]
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) / math.sqrt(h)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v)
    return nn.DenseGeneral(D, axis=(-2, -1), name='o')(out)


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, ids, positions, init_cache: bool = False):
    x = nn.Embed(VOCAB, D)(ids) + nn.Embed(LEN, D)(positions)
    for i in range(LAYERS):
      x = x + Attention(name=f'h_{i}')(nn.LayerNorm()(x), init_cache)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def linen_greedy(model, params, prompt, new, forced=None):
  zeros = jnp.zeros((1, LEN), jnp.int32)
  cache = model.init(jax.random.key(1), zeros, zeros, init_cache=True)
  cache = cache['cache']
  step = jax.jit(
    lambda c, ids, pos: model.apply(
      {'params': params, 'cache': c}, ids, pos, mutable=['cache']
    )
  )
  ids, pos = jnp.asarray([prompt]), jnp.arange(len(prompt))[None]
  toks, logits = [], []
  for _ in range(new):
    lg, upd = step(cache, ids, pos)
    cache = upd['cache']
    logits.append(lg[0, -1])
    toks.append(int(jnp.argmax(lg[0, -1])))
    nxt = toks[-1] if forced is None else forced[len(toks) - 1]
    ids, pos = jnp.asarray([[nxt]]), pos[:, -1:] + 1
  return toks, jnp.stack(logits), cache_bytes(cache)


class NnxLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos = nnx.Embed(LEN, D, rngs=rngs)
    self.layers = nnx.List(
      [
        nnx.MultiHeadAttention(
          num_heads=HEADS, in_features=D, decode=True, rngs=rngs
        )
        for _ in range(LAYERS)
      ]
    )
    self.out = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, ids, positions):
    x = self.embed(ids) + self.pos(positions)
    for layer in self.layers:
      x = x + layer(x)
    return self.out(x)


def nnx_greedy(rule, prompt, new, forced=None):
  model = NnxLM(nnx.Rngs(0))
  for layer in model.layers:
    layer.init_cache((1, LEN, D))
  if rule is not None:
    quantize_cache(model, rule)
  step = nnx.jit(lambda m, ids, pos: m(ids, pos))
  inputs, toks, logits = list(prompt), [], []
  for p in range(len(prompt) + new - 1):
    lg = step(model, jnp.asarray([[inputs[p]]]), jnp.asarray([[p]]))
    if p >= len(prompt) - 1:
      logits.append(lg[0, -1])
      toks.append(int(jnp.argmax(lg[0, -1])))
      inputs.append(toks[-1] if forced is None else forced[len(toks) - 1])
  return toks, jnp.stack(logits), cache_bytes(nnx.state(model, nnx.Cache))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--new', type=int, default=32)
  p.add_argument('--blocks', type=int, nargs='*', default=[32, 64])
  args = p.parse_args()
  print(f'CPU: {host.cpu_model()}; jax {jax.__version__}')
  print(
    f'command: python benchmarks/kv_cache_rules.py {" ".join(sys.argv[1:])}'
  )
  print(f'date: {datetime.date.today()}\n')
  prompt = np.random.default_rng(0).integers(0, VOCAB, 16).tolist()
  lm = LinenLM()
  zeros = jnp.zeros((1, LEN), jnp.int32)
  params = jax.jit(lm.init)(jax.random.key(0), zeros, zeros)['params']
  runs = {
    'linen (HF style)': lambda rule, forced=None: linen_greedy(
      lm if rule is None else quantize_cache(lm, rule),
      params,
      prompt,
      args.new,
      forced,
    ),
    'nnx (nnx.Cache)': lambda rule, forced=None: nnx_greedy(
      rule, prompt, args.new, forced
    ),
  }
  print(
    '| model | cache | bytes/token | x float | max logit change | '
    'top-1 = float | greedy tokens = float |'
  )
  print('|---|---|---|---|---|---|---|')
  cells = [('none', 0), ('int8', 0), ('fp8', 0), ('int4', 0)]
  cells += [(f, b) for b in args.blocks for f in ('int8', 'int4')]
  for name, run in runs.items():
    toks, logits, nbytes = run(None)
    for fmt, block in cells:
      rule = CacheRule(numerics=fmt, block=block)
      top1, lg, qbytes = run(rule, toks)  # Fed the float run's tokens.
      change = float(jnp.max(jnp.abs(lg - logits)) / jnp.max(jnp.abs(logits)))
      agree = np.mean(np.asarray(top1) == np.asarray(toks))
      free = np.mean(np.asarray(run(rule)[0]) == np.asarray(toks))
      label = f'{fmt} per {block} slots' if block else fmt
      print(
        f'| {name} | {label} | {qbytes / LEN:.0f} | {qbytes / nbytes:.3f} | '
        f'{change:.2e} | {agree:.2f} | {free:.2f} |'
      )


if __name__ == '__main__':
  main()
