"""The KV cache's read alone: float vs int8 dequantized vs int8 dots.

One decode step's cache work for a 4-layer stack (8 heads of 64, the
shapes of benchmarks/decode.py): per layer, write one token into the
cache (`aqtr.pax.kv_cache.write`) and attend one query over all its
slots (`attend`), chained so each layer's output is the next one's query.
No weights: this isolates what `KVCacheConfig.read` chooses between.
Eight steps run in one jitted `fori_loop` over donated caches; a cell's
time is the minimum over `--rounds` interleaved rounds of 3 calls each.

Columns: `float us/step` (a float32 cache), then each int8 read's speed
as float time / its time (> 1: faster than the float cache).

Run: python benchmarks/kv_read.py [--batches 1 2 4 8] [--contexts 256
1024] [--rounds 8] (the host is shared: compare ratios of one run)
"""

from __future__ import annotations

import argparse
import os
import time

import host
import jax
import jax.numpy as jnp
import numpy as np

from aqtr.pax import kv_cache
from aqtr.pax.kv_cache import KVCacheConfig

HEADS, HEAD, LAYERS, STEPS = 8, 64, 4, 8
READS = {
  'float': KVCacheConfig(),
  'int8 dequantize': KVCacheConfig(numerics='int8', read='dequantize'),
  'int8 dots': KVCacheConfig(numerics='int8', read='int8_dots'),
}


def cell(cfg: KVCacheConfig, batch: int, slots: int, rng) -> list:
  """[compiled step, caches, query] of one (read, batch, slots) cell."""
  caches = []
  for _ in range(LAYERS):
    layer = kv_cache.init_layer(
      cfg, batch=batch, length=slots, num_heads=HEADS, head_dim=HEAD
    )
    kv = jnp.asarray(rng.normal(size=(batch, slots, HEADS, HEAD)), jnp.float32)
    caches.append(kv_cache.write(cfg, layer, kv, kv, 0))
  q = jnp.asarray(rng.normal(size=(batch, 1, HEADS, HEAD)) / 8, jnp.float32)
  mask = jnp.ones((batch, 1, 1, slots), bool)

  def steps(caches, q):
    def body(_, c):
      caches, x = c
      out = []
      for layer in caches:
        layer = kv_cache.write(cfg, layer, x, x, slots - 1)
        x = kv_cache.attend(cfg, layer, x, mask)
        out.append(layer)
      return tuple(out), x

    return jax.lax.fori_loop(0, STEPS, body, (tuple(caches), q))

  f = jax.jit(steps, donate_argnums=0).lower(tuple(caches), q).compile()
  return [f, tuple(caches), q]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--batches', type=int, nargs='+', default=[1, 2, 4, 8])
  p.add_argument('--contexts', type=int, nargs='+', default=[256, 1024])
  p.add_argument('--rounds', type=int, default=8)
  args = p.parse_args()
  host.header('kv_read.py')
  rng = np.random.default_rng(0)
  cells = {
    (s, b, name): cell(cfg, b, s, rng)
    for s in args.contexts
    for b in args.batches
    for name, cfg in READS.items()
  }
  best = dict.fromkeys(cells, float('inf'))
  for _ in range(args.rounds):
    for key, c in cells.items():
      f, caches, q = c
      caches, x = f(caches, q)
      for _ in range(3):
        t = time.perf_counter()
        caches, x = f(caches, q)
        x.block_until_ready()
        best[key] = min(best[key], (time.perf_counter() - t) / STEPS)
      c[1] = caches
  print(f'load average (1, 5, 15 min): {os.getloadavg()}\n')
  print('| slots | batch | float us/step | int8 dequantize x float | ', end='')
  print('int8 dots x float |')
  print('|---|---|---|---|---|')
  for s in args.contexts:
    for b in args.batches:
      f = best[(s, b, 'float')]
      d = best[(s, b, 'int8 dequantize')]
      i = best[(s, b, 'int8 dots')]
      print(f'| {s} | {b} | {1e6 * f:.0f} | {f / d:.2f} | {f / i:.2f} |')


if __name__ == '__main__':
  main()
