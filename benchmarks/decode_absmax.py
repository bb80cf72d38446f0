"""AbsMax's CPU forms in one decode loop, same process (issues 34, 36).

`benchmarks/decode.py`'s model (d_model 512, 4 layers, 8 heads, 256
slots) decoding with int8 weights and an int8 KV cache, and with float
ones, at batches 1 and 8. Two int8 decoders per batch are compiled in this
process: one traced with `AbsMax`'s two-reduction CPU form for every
operand (`LIBRARY_MIN_SIZE = 0`: the form before the integer max), one with
the default (the integer max over the bits below `LIBRARY_MIN_SIZE`,
32768 values since issue 34's batch-8 round). Their
rounds alternate; tokens must be equal. Prints the loop body's thunks per
step and the minimum wall and process CPU ms per step.

Run: python benchmarks/decode_absmax.py [--rounds 7] [--steps 32]
"""

from __future__ import annotations

import argparse
from unittest import mock

import decode as bench
import decode_dots
import host
import numpy as np

from aqtr.calibrations import absmax
from aqtr.pax import decode
from aqtr.pax.kv_cache import KVCacheConfig


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=7)
  p.add_argument('--steps', type=int, default=32)
  args = p.parse_args()
  host.header('decode_absmax.py')
  models = bench.models_by_weights(256, 512, 4, 8)
  default = absmax.LIBRARY_MIN_SIZE
  rows = [
    ('float', 'float', KVCacheConfig(), default),
    ('int8, two reductions', 'int8', KVCacheConfig(numerics='int8'), 0),
    ('int8, integer max', 'int8', KVCacheConfig(numerics='int8'), default),
  ]
  rng = np.random.default_rng(0)
  cells, thunks = [], {}
  for batch in (1, 8):
    prompts = rng.integers(0, 256, (batch, 8)).tolist()
    for label, w, kv, size in rows:
      lm, variables = models[w]
      dec = decode.Decoder(lm, length=256, kv=kv)
      switch = mock.patch.object(absmax, 'LIBRARY_MIN_SIZE', size)
      thunks[(label, batch)] = decode_dots.compile_cell(
        dec, variables, prompts, args.steps, switch
      )
      cells.append(((label, batch), dec, variables, prompts))
  best, cpu = decode_dots.time_cells(
    cells, args.rounds, args.steps, lambda k: (k[0].split(',')[0], k[1])
  )
  print(f'load average (1, 5, 15 min): {host.load_average()}')
  print(f'\n{args.steps} steps per cell, min of {args.rounds} rounds\n')
  print(
    '| weights + cache, absmax form | batch | thunks per step | ms/step '
    '| x float | cpu ms/step | cpu x float |'
  )
  print('|---|---|---:|---:|---:|---:|---:|')
  for (label, batch), *_ in cells:
    f, fc = best[('float', batch)], cpu[('float', batch)]
    b, c = best[(label, batch)], cpu[(label, batch)]
    print(
      f'| {label} | {batch} | {thunks[(label, batch)]} | '
      f'{1e3 * b / args.steps:.3f} | {f / b:.2f} | '
      f'{1e3 * c / args.steps:.3f} | {fc / c:.2f} |'
    )


if __name__ == '__main__':
  main()
