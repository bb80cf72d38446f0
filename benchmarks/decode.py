"""Decoding speed and memory: float vs int8 weights, float vs int8 KV cache.

The main job's LM architecture (`aqtr.train.models.lm`: pre-LayerNorm
blocks, untied logits, byte vocabulary 256) at a size where weights
dominate: d_model 512, 4 layers, 8 heads (head_dim 64), MLP 2048, learned
positions up to the longest context. Random weights (speed does not depend
on them). Rows:

  float w + float kv   the float model (TRAIN mode, no quantization)
  int8 w + float kv    frozen int8 weights (CONVERT -> SERVE, as
                       aqtr-train serves), float32 cache
  int8 w + int8 kv     the same weights, int8 cache read by dequantizing
  int8 w + int8 kv dots  int8 cache, QK^T and PV as int8 x int8 dots
  int8 w + int4 kv     int4 cache (packed), dequantized

Each cell decodes `--steps` tokens per sequence after an 8-token prompt,
with a cache of `context` slots: the cache has a fixed size and every step
reads all of its slots (masked), so a step costs the same at any fill.
tokens/s counts all sequences of the batch; times are the decode loop
only (`lax.while_loop` under jit, compiled ahead), minimum over
`--rounds` interleaved rounds (every cell once per round, in turn).

Run: python benchmarks/decode.py [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse

import host
import jax
import jax.numpy as jnp
import numpy as np

import aqtr
import aqtr.flax.linen as aqtr_linen
from aqtr.flax import common
from aqtr.freezers import Mode
from aqtr.pax import decode
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.train import models


def _models(max_len: int, d_model: int, layers: int, heads: int):
  template = models.lm(
    vocab_size=256,
    seq_len=max_len,
    d_model=d_model,
    num_layers=layers,
    num_heads=heads,
  )
  x = jnp.zeros((1, max_len), jnp.int32)
  float_lm = models.build(template)
  params = jax.jit(float_lm.init)(jax.random.key(0), x)
  injected, _ = models.inject(template, aqtr.presets.int8())
  conv = models.build(models.serving_template(injected, Mode.CONVERT))
  served = jax.jit(lambda v: aqtr_linen.convert(conv, v, x))(params)
  int8_lm = models.build(models.serving_template(injected, Mode.SERVE))
  return (float_lm, params), (int8_lm, served)


ROWS = [
  ('float w + float kv', 'float', KVCacheConfig()),
  ('int8 w + float kv', 'int8', KVCacheConfig()),
  ('int8 w + int8 kv', 'int8', KVCacheConfig(numerics='int8')),
  (
    'int8 w + int8 kv dots',
    'int8',
    KVCacheConfig(numerics='int8', read='int8_dots'),
  ),
  ('int8 w + int4 kv', 'int8', KVCacheConfig(numerics='int4')),
]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--steps', type=int, default=32)
  p.add_argument('--batches', type=int, nargs='+', default=[1, 8])
  p.add_argument('--contexts', type=int, nargs='+', default=[256, 1024])
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--heads', type=int, default=8)
  args = p.parse_args()
  print(f'CPU: {host.cpu_model()}; jax {jax.__version__}; {jax.devices()[0]}')
  (flm, fvars), (qlm, qvars) = _models(
    max(args.contexts), args.d_model, args.layers, args.heads
  )
  weights = {'float': (flm, fvars), 'int8': (qlm, qvars)}
  wbytes = {k: common.nbytes(v) for k, (_, v) in weights.items()}
  rng = np.random.default_rng(0)
  cells, decoders = [], {}
  for context in args.contexts:
    for batch in args.batches:
      prompt = min(8, context - args.steps)
      prompts = rng.integers(0, 256, (batch, prompt)).tolist()
      for label, w, kv in ROWS:
        cells.append((label, w, kv, batch, context, prompts))
  best: dict = {}
  for r in range(args.rounds):
    for label, w, kv, batch, context, prompts in cells:
      lm, variables = weights[w]
      key = (w, kv, context)
      if key not in decoders:
        decoders[key] = decode.Decoder(lm, length=context, kv=kv)
      out = decoders[key].generate(variables, prompts, args.steps + 1)
      assert len(out.tokens[0]) == args.steps + 1, out.stopped
      cell = (label, batch, context)
      if cell not in best or out.decode_s < best[cell][0].decode_s:
        best[cell] = (out, w)
    print(f'round {r + 1}/{args.rounds} done', flush=True)
  print(
    f'\nd_model {args.d_model}, {args.layers} layers, {args.heads} heads; '
    f'{args.steps} decode steps per cell; min of {args.rounds} rounds\n'
  )
  print(
    '| weights + cache | batch | context | tokens/s | x float | ms/step '
    '| weight MB | KV MB | KV x f32 |'
  )
  print('|---|---|---|---|---|---|---|---|---|')
  for context in args.contexts:
    for batch in args.batches:
      base = best[('float w + float kv', batch, context)][0]
      for label, _, _ in ROWS:
        out, w = best[(label, batch, context)]
        ms = 1e3 * out.decode_s / args.steps
        print(
          f'| {label} | {batch} | {context} | {out.tokens_per_s:.0f} | '
          f'{out.tokens_per_s / base.tokens_per_s:.2f} | {ms:.2f} | '
          f'{wbytes[w] / 2**20:.1f} | {out.kv_bytes / 2**20:.2f} | '
          f'{out.kv_bytes / base.kv_bytes:.3f} |'
        )


if __name__ == '__main__':
  main()
