"""Served Q, K and V as one dot or three, in one decode process (issue 34).

`benchmarks/decode.py`'s model (d_model 512, 4 layers, 8 heads) decoding
with int8 weights and an int8 KV cache, and with float ones, at batches 1
and 8. Two int8 decoders per batch and context are compiled in this
process: one traced with `aqtr.pax.merged` refusing every merge (three
projection dots per layer, the form before the merge), one with the
default (one dot over the concatenated frozen weights). Their rounds
alternate; their tokens must be equal. Prints the loop body's thunks per
step and the minimum wall and process CPU ms per step.

Run: python benchmarks/decode_merged.py [--rounds 7] [--steps 32]
[--contexts 256 1024]
"""

from __future__ import annotations

import argparse

import decode as bench
import decode_dots
import host
import jax
import numpy as np

from aqtr.pax import decode, merged
from aqtr.pax.kv_cache import KVCacheConfig


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=7)
  p.add_argument('--steps', type=int, default=32)
  p.add_argument('--contexts', type=int, nargs='+', default=[256])
  args = p.parse_args()
  host.header('decode_merged.py')
  models = bench.models_by_weights(max(args.contexts), 512, 4, 8)
  rows = [
    ('float', 'float', KVCacheConfig(), True),
    ('int8, three dots', 'int8', KVCacheConfig(numerics='int8'), False),
    ('int8, one qkv dot', 'int8', KVCacheConfig(numerics='int8'), True),
  ]
  rng = np.random.default_rng(0)
  cells, thunks = [], {}
  default = merged.mergeable
  for context in args.contexts:
    for batch in (1, 8):
      prompts = rng.integers(0, 256, (batch, 8)).tolist()
      for label, w, kv, merge in rows:
        lm, variables = models[w]
        dec = decode.Decoder(lm, length=context, kv=kv)
        if not merge:
          merged.mergeable = lambda *a, **k: False
        jax.clear_caches()  # Trace anew (jit caches traces by function).
        try:  # Traced and compiled here, with this form.
          dec.generate(variables, prompts, args.steps + 1)
        finally:
          merged.mergeable = default
        ((_, loop),) = dec._compiled.values()
        key = (label, batch, context)
        thunks[key] = sum(decode_dots._body_kinds(loop.as_text()).values())
        cells.append((key, dec, variables, prompts))
  best, cpu, tokens = {}, {}, {}
  for _ in range(args.rounds):
    for key, dec, variables, prompts in cells:
      out = dec.generate(variables, prompts, args.steps + 1)
      best[key] = min(best.get(key, float('inf')), out.decode_s)
      cpu[key] = min(cpu.get(key, float('inf')), out.decode_cpu_s)
      same = (key[0].split(',')[0], *key[1:])  # The weights' tokens.
      assert out.tokens == tokens.setdefault(same, out.tokens), key
  print(f'load average (1, 5, 15 min): {host.load_average()}')
  print(f'\n{args.steps} steps per cell, min of {args.rounds} rounds\n')
  print(
    '| weights + cache, projections | batch | context | thunks per step '
    '| ms/step | x float | cpu ms/step | cpu x float |'
  )
  print('|---|---|---|---:|---:|---:|---:|---:|')
  for key, *_ in cells:
    label, batch, context = key
    f, fc = best[('float', batch, context)], cpu[('float', batch, context)]
    b, c = best[key], cpu[key]
    print(
      f'| {label} | {batch} | {context} | {thunks[key]} | '
      f'{1e3 * b / args.steps:.3f} | {f / b:.2f} | '
      f'{1e3 * c / args.steps:.3f} | {fc / c:.2f} |'
    )


if __name__ == '__main__':
  main()
