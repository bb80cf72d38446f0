"""KV-cache quantization: quality (teacher-forced bpc) and memory per token.

Takes the serving checkpoint of an `aqtr-train` LM run (frozen int8/fp8
weights) and its experiment's validation split, and reads every
validation window through the cache (one prefill per window: every query
reads the keys and values as stored), for each cache config:

  float     float32 keys and values
  int8      per token and head (absmax), read by dequantizing
  int8 dots the same cache, QK^T and PV as int8 x int8 dots
  fp8       e4m3fn, per token and head
  int4      per token and head / per head over blocks of 16 and 64 slots

Table 1: bpc and its change against the float cache. Table 2: KV bytes
per token (all layers) against float32, and the cache size of one
sequence at several context lengths, for this model's shape.

Run (after `aqtr-train --out_dir=OUT`):
  python benchmarks/kv_cache.py --serving=OUT/int8/serving
"""

from __future__ import annotations

import argparse
import json
import pathlib

from aqtr import fiddle as aqtr_fiddle
from aqtr.pax import kv_cache
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.train import experiment, generate, tasks

CONFIGS = [
  ('float', KVCacheConfig()),
  ('int8 token', KVCacheConfig(numerics='int8')),
  ('int8 token, int8 dots', KVCacheConfig(numerics='int8', read='int8_dots')),
  ('int8 block 16', KVCacheConfig(numerics='int8', scales='block')),
  ('fp8 token', KVCacheConfig(numerics='fp8')),
  ('int4 token', KVCacheConfig(numerics='int4')),
  ('int4 block 16', KVCacheConfig(numerics='int4', scales='block')),
  (
    'int4 block 64',
    KVCacheConfig(numerics='int4', scales='block', block_size=64),
  ),
]


def bytes_per_token(served, kv: KVCacheConfig, length: int) -> float:
  dec = generate.decoder(served.model, kv, length)
  cache = dec.init(1, [0])
  return kv_cache.nbytes(cache.layers) / length


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--serving', required=True, help='<out>/<run>/serving')
  p.add_argument('--contexts', type=int, nargs='+', default=[256, 1024, 8192])
  args = p.parse_args()
  path = pathlib.Path(args.serving)
  served = generate.load(path)
  cfg = aqtr_fiddle.loads((path.parent.parent / 'config.json').read_text())
  exp = experiment.split(cfg)[0]
  task = tasks.make(exp)
  summary = json.loads((path.parent.parent / 'summary.json').read_text())
  run = path.parent.name
  reported = next(r['bpc'] for r in summary if r['run'] == run)
  print(f'{path}: {task.info}')
  print(f'run {run!r}: validation bpc {reported:.4f} (full forward, job)\n')
  print('| KV cache | bpc | vs float cache |')
  print('|---|---|---|')
  base = None
  window = task.eval_set[0][0].shape[1]
  for label, kv in CONFIGS:
    if kv.scales == 'block' and window % kv.block_size:
      continue  # The cache is one window long.
    bpc = generate.cache_bpc(served.model, served.variables, task.eval_set, kv)
    base = bpc if base is None else base
    print(f'| {label} | {bpc:.4f} | {100 * (bpc / base - 1):+.3f}% |')
  att = served.template.layers[0].attention
  heads = att.num_heads
  head_dim = att.q_proj.features // heads
  layers = len(served.template.layers)
  print(
    f'\nKV memory ({layers} layers, {heads} heads, head_dim {head_dim}; '
    'one sequence)\n'
  )
  head = ' | '.join(f'{c} tokens' for c in args.contexts)
  print(f'| KV cache | bytes/token | x float32 | {head} |')
  print('|---|---|---|' + '---|' * len(args.contexts))
  f32 = bytes_per_token(served, KVCacheConfig(), 64)
  for label, kv in CONFIGS:
    if 'dots' in label or (kv.scales == 'block' and 64 % kv.block_size):
      continue
    per = bytes_per_token(served, kv, 64)
    cells = ' | '.join(f'{per * c / 2**10:.0f} KB' for c in args.contexts)
    print(f'| {label} | {per:.0f} | {per / f32:.3f} | {cells} |')


if __name__ == '__main__':
  main()
