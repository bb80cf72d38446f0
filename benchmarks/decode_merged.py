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
import contextlib
from unittest import mock

import decode as bench
import decode_dots
import host
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
  for context in args.contexts:
    for batch in (1, 8):
      prompts = rng.integers(0, 256, (batch, 8)).tolist()
      for label, w, kv, merge in rows:
        lm, variables = models[w]
        dec = decode.Decoder(lm, length=context, kv=kv)
        switch = (
          contextlib.nullcontext()
          if merge
          else mock.patch.object(merged, 'mergeable', lambda *a, **k: False)
        )
        key = (label, batch, context)
        thunks[key] = decode_dots.compile_cell(
          dec, variables, prompts, args.steps, switch
        )
        cells.append((key, dec, variables, prompts))
  best, cpu = decode_dots.time_cells(
    cells, args.rounds, args.steps, lambda k: (k[0].split(',')[0], *k[1:])
  )
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
